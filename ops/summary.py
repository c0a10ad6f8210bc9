"""Reading a stage's summary.json on the laptop: its schema and the provenance facts ops shows and compares.

Owns which summary schema versions this ops understands (pipeline/formats.py writes ``schema``
"eagle-ops.summary" and ``schema_version``), the one-line note for a summary it cannot vouch for (none from
a pipeline older than the schema, or a newer version), and the provenance facts taken from a summary (product
version and commit, image digest, patch-set hash) that a multi-host merge compares between hosts. Pure: takes
the parsed JSON, never reads files or the network.
"""

from __future__ import annotations

SCHEMA = "eagle-ops.summary"
KNOWN_VERSIONS = (1,)
FACTS = ("version", "commit", "image_digest", "patches")


def schema_note(summary: dict) -> str | None:
    """None for a summary under a schema version this ops reads; else one line saying what it is."""
    schema, version = summary.get("schema"), summary.get("schema_version")
    if schema is None:
        return "summary.json has no schema: written by a pipeline older than the versioned summary (2026-12)"
    if schema != SCHEMA:
        return f"summary.json has schema {schema!r}, not {SCHEMA!r}: not a stage summary of this product"
    if version not in KNOWN_VERSIONS:
        return (f"summary.json schema_version {version!r} is not one this ops reads ({', '.join(map(str, KNOWN_VERSIONS))}):"
                " update ops to read it")
    return None


def provenance_facts(summary: dict | None) -> dict:
    """Version, commit, image digest and patch-set hash of the run that wrote ``summary`` (None where unknown)."""
    prov = (summary or {}).get("provenance") or {}
    product = prov.get("product") or {}
    return {"version": product.get("version"), "commit": product.get("commit"),
            "image_digest": prov.get("image_digest"), "patches": (prov.get("patches") or {}).get("sha256")}


def disagreements(facts: list[dict]) -> list[str]:
    """The facts on which hosts that report them differ (e.g. ["image_digest"]: not one image everywhere)."""
    return [k for k in FACTS if len({f.get(k) for f in facts if f.get(k) is not None}) > 1]
