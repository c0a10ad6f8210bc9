"""ops' reading of the versioned stage summary: schema notes, provenance facts, and hosts that disagree."""

from __future__ import annotations

import io

from rich.console import Console

from contract.summary import disagreements, provenance_facts, schema_note
from ops import report


def stage_summary(version=1, digest="sha256:aa", commit="c1") -> dict:
    return {
        "ok": True,
        "checks": [],
        "schema": "eagle-ops.summary",
        "schema_version": version,
        "provenance": {
            "product": {"version": "0.1.0", "commit": commit},
            "image_digest": digest,
            "patches": {"sha256": "p1"},
        },
    }


def test_schema_notes_name_what_ops_cannot_vouch_for():
    """A current summary has no note; one without schema, of another schema or of a newer version is named."""
    assert schema_note(stage_summary()) is None
    assert "no schema" in schema_note({"ok": True})
    assert "not 'eagle-ops.summary'" in schema_note({**stage_summary(), "schema": "other"})
    assert "schema_version 2 is not one this ops reads (1): update ops" in schema_note(
        stage_summary(version=2)
    )


def test_provenance_facts_and_disagreements():
    """Facts come from the summary's provenance; hosts with different images or commits are named, unknowns
    are not."""
    facts = provenance_facts(stage_summary())
    assert facts == {"version": "0.1.0", "commit": "c1", "image_digest": "sha256:aa", "patches": "p1"}
    assert provenance_facts(None) == dict.fromkeys(facts)
    same = [facts, provenance_facts(stage_summary())]
    assert disagreements(same) == []
    other = provenance_facts(stage_summary(digest="sha256:bb", commit="c2"))
    assert disagreements([facts, other]) == ["commit", "image_digest"]
    assert (
        disagreements([facts, provenance_facts({"ok": True})]) == []
    )  # an old summary knows nothing: no claim


def test_print_summary_says_how_the_output_was_made_or_why_it_cannot():
    """The one-host table is followed by the provenance line, or by the schema note of an old summary."""
    out = io.StringIO()
    report.print_summary(Console(file=out, width=200), stage_summary(), 0, "runs/x")
    assert "made by eagle-ops version 0.1.0, commit c1, image_digest sha256:aa, patches p1" in out.getvalue()
    out = io.StringIO()
    report.print_summary(Console(file=out, width=200), {"ok": True, "checks": []}, 0, "runs/x")
    assert "no schema" in out.getvalue() and "made by" not in out.getvalue()
