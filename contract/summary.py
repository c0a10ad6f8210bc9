"""The versioned summary record: the ``summary.json`` a stage writes next to its output and ops reads.

Owns the schema name and version a writer stamps (pipeline/ondisk/provenance.py ``stamp``), which versions a
reader understands, the one-line note for a summary a reader cannot vouch for, and the provenance facts a
multi-host merge compares between hosts. Version 1 added ``schema``, ``schema_version``, ``provenance`` and
``source_provenance`` (the checked output's own record) to the keys readers had before (kind, path, ok,
stats, failures, checks), which are unchanged. A new version adds a number to READ_VERSIONS in the same
change that writes it. A hidden-states summary that extract wrote as its closing check also says, in
``stats``, which check ran (``closing_check``: one of CLOSING_CHECKS; "record" judged the writer's record
and stat'ed each file, "full" read every byte back), what it proved (``closing_check_note``) and its seconds
(``closing_check_seconds``); a summary of ``pipeline verify`` has none of them (it always reads every byte).
These keys are additions within version 1. Pure: takes and returns parsed JSON.
"""

from __future__ import annotations

FILE = "summary.json"
SCHEMA = "eagle-ops.summary"
VERSION = 1  # what this product writes
READ_VERSIONS = (1,)  # what this product reads
FACTS = ("version", "commit", "image_digest", "patches")
CLOSING_CHECKS = ("record", "full")  # stats.closing_check of extract's summary: the default first


def header() -> dict:
    """The keys every summary carries besides its stage's own: schema and version."""
    return {"schema": SCHEMA, "schema_version": VERSION}


def schema_note(summary: dict) -> str | None:
    """None for a summary under a schema version this product reads; else one line saying what it is."""
    schema, version = summary.get("schema"), summary.get("schema_version")
    if schema is None:
        return "summary.json has no schema: written by a pipeline older than the versioned summary (2026-12)"
    if schema != SCHEMA:
        return f"summary.json has schema {schema!r}, not {SCHEMA!r}: not a stage summary of this product"
    if version not in READ_VERSIONS:
        return (
            f"summary.json schema_version {version!r} is not one this ops reads "
            f"({', '.join(map(str, READ_VERSIONS))}): update ops to read it"
        )
    return None


def provenance_facts(summary: dict | None) -> dict:
    """Version, commit, image digest and patch-set hash of the run that wrote ``summary`` (None where
    unknown)."""

    def obj(value: object) -> dict:  # a summary from a host may hold anything where an object belongs
        return value if isinstance(value, dict) else {}

    prov = obj(obj(summary).get("provenance"))
    product = obj(prov.get("product"))
    return {
        "version": product.get("version"),
        "commit": product.get("commit"),
        "image_digest": prov.get("image_digest"),
        "patches": obj(prov.get("patches")).get("sha256"),
    }


def disagreements(facts: list[dict]) -> list[str]:
    """The facts on which hosts that report them differ (e.g. ["image_digest"]: not one image everywhere)."""
    return [k for k in FACTS if len({f.get(k) for f in facts if f.get(k) is not None}) > 1]
