"""Resume and repair: the ``--resume``/``--overwrite`` policy of the output directory (this run's
data_config.json or a one-line refusal; files that belong to another run refused; ``--repair`` re-reads every
byte and regenerates what fails), the scratch folders a killed vLLM engine left, the checksums of files
written without one, and the batches left to run."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import click

from pipeline.ondisk import formats, integrity
from pipeline.ondisk.atomic import remove_partials
from pipeline.errors import StageError
from pipeline.ondisk.outdir import refuse_overlap
from pipeline.extract.config import ExtractConfig
from pipeline.extract.plan import Batch

VLLM_SCRATCH_GLOB = ".vllm-states-*"  # pipeline/backends/vllm.py's per-run scratch folders in --out


def pending_batches(batches: list[Batch], done: set[int]) -> list[Batch]:
    """The batches left to run: a batch is recomputed whole unless every one of its samples is done, so a
    resumed run writes the same bytes as an uninterrupted one (pure)."""
    return [b for b in batches if not all(i in done for i in b.indices)]


def prepare_output_dir(
    cfg: ExtractConfig,
    expected: formats.DataConfig,
    prepared: formats.PreparedSamples | None = None,
    owned: set[int] | None = None,
) -> set[int]:
    """Apply the --resume/--overwrite policy; return the sample indices already complete.

    --resume continues a run only if its data_config.json is this run's and each existing file it would skip
    (those of ``owned``, this host's samples; default all) belongs to this run
    (``integrity.foreign_files``: the file mapped, not read: its input_ids and loss_mask against prepared row
    i, its states' count, shapes and dtype against this run's config; its size, and its bytes only if it
    changed after the set's checksum records, against them). Either refusal is one line, before anything in
    --out changes. --resume --repair instead reads every byte of every file (``integrity.damaged_files``) and
    regenerates the ones that fail."""
    out = cfg.out
    refuse_overlap(out, {"--prepared": cfg.prepared, "--model": cfg.model})
    existing = formats.existing_data_indices(out)
    has_config = (out / formats.DATA_CONFIG).exists()
    if cfg.resume and cfg.overwrite:
        raise StageError("--resume and --overwrite contradict each other: choose one")
    if cfg.repair and not cfg.resume:
        raise StageError("--repair works on an existing run: pass it together with --resume")
    if out.exists() and not out.is_dir():
        raise StageError(f"output {out} exists and is not a directory: choose another --out")
    if (existing or has_config or (out.is_dir() and any(out.iterdir()))) and not (
        cfg.resume or cfg.overwrite
    ):
        raise StageError(
            f"output dir {out} is not empty: pass --resume to continue it or --overwrite to replace it"
        )
    if cfg.resume and has_config:
        found = formats.read_data_config(out)
        mismatch = formats.resume_mismatch(found, expected)
        if mismatch:
            raise StageError(
                f"cannot --resume {out}: its data_config.json has {mismatch}; "
                "use --overwrite or another --out"
            )
        expected.provenance_history = [
            *found.provenance_history,
            *([found.provenance] if found.provenance else []),
        ]
    kept = [i for i in existing if i < expected.num_samples and (owned is None or i in owned)]
    if prepared is None and kept and cfg.resume:
        prepared = formats.read_prepared(cfg.prepared)[0]
    if cfg.resume and not cfg.repair and kept:
        refuse_foreign_files(out, kept, expected, prepared)
    if cfg.overwrite and out.is_dir():
        shutil.rmtree(out)
        existing, has_config = [], False
    out.mkdir(parents=True, exist_ok=True)
    remove_partials(out)
    for stale in out.glob(VLLM_SCRATCH_GLOB):  # the vllm backend's files of a run that was killed
        shutil.rmtree(stale, ignore_errors=True)
    formats.write_data_config(out, expected)
    if cfg.repair:
        bad = integrity.damaged_files(out, kept, expected, prepared)
        for i, reason in sorted(bad.items()):
            click.echo(f"repair: data_{i}.pt will be regenerated ({reason})", err=True)
            formats.data_file(out, i).unlink()
        existing = [i for i in existing if i not in bad]
    return set(existing)


def refuse_foreign_files(out: Path, indices: list[int], expected: formats.DataConfig, prepared) -> None:
    """One line naming the first of ``indices`` that is not this run's file (and how many more there are)."""
    foreign = integrity.foreign_files(out, indices, expected, prepared)
    if foreign:
        first = min(foreign)
        more = f" (and {len(foreign) - 1} more files)" if len(foreign) > 1 else ""
        raise StageError(
            f"cannot --resume {out}: {formats.data_file(out, first).name} is not this run's file "
            f"({foreign[first]}){more}: "
            "pass --repair with --resume to regenerate such files, or --overwrite to start over"
        )


def record_missing_checksums(out: Path, done: set[int]) -> None:
    """Resume: record the files already complete that no index or journal records (written before checksums
    existed, or by a run killed between a file's rename and its journal line), so that every file has one;
    and record again, with their current mtime, the files whose record's mtime or size they no longer have
    (copied, or touched) while their bytes are still the recorded ones. Each is read once: its sha256 and,
    where it reads as a sample, its value facts. A file whose bytes differ from its record keeps that record
    (the closing check names it: ``refuse_foreign_files`` hashes only files changed after the records);
    files recorded by an older extract without facts are left as they are (the closing check reads them)."""
    recorded = formats.read_checksums(out)

    def stale(i: int) -> bool:
        path, want = formats.data_file(out, i), recorded.get(formats.data_file(out, i).name)
        if want is None:
            return True
        st = path.stat()
        return integrity.has_facts(want) and (st.st_mtime_ns != want.mtime_ns or st.st_size != want.bytes)

    missing = sorted(i for i in done if stale(i))
    if not missing:
        return
    click.echo(
        f"resume: recording the checksums of {len(missing)} files written without one (or changed since)",
        err=True,
    )
    journal, load = formats.ChecksumJournal(out), integrity.reader_loads()
    try:
        for i in missing:
            path = formats.data_file(out, i)
            mtime = path.stat().st_mtime_ns
            try:
                d, digest = load(path)
                facts = integrity.written_facts(d["input_ids"], d["hidden_states"], d["loss_mask"])
            except Exception:  # noqa: BLE001 - not a readable sample: its checksum only; the closing check reads it
                digest, facts = formats.file_digest(path), None
            if (want := recorded.get(path.name)) is not None and digest.sha256 != want.sha256:
                # other bytes than recorded under an old mtime (not hashed by the resume check): kept as named
                continue
            journal.record(
                path.name, replace(digest, mtime_ns=mtime if facts is not None else None, facts=facts)
            )
    finally:
        journal.close()
