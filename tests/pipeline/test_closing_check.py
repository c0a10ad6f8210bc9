"""extract's closing check by the writer's record passes a good set, names each damage it can see, and
leaves the rest to the full read.

Every test takes a copy of the session's extract (the ``states`` fixture, tests/pipeline/conftest.py),
damages it with the project's own writer or plain file operations, and runs the closing check in process
(``verify.verify`` with ``closing_check``), or extract itself through the CLI where the run matters.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from pipeline import verify
from pipeline.ondisk import integrity

from pipeline.ondisk import formats
from pipeline.extract.writer import Sample, Writer
from pipeline.verify import VerifyConfig
from tests.conftest import run_extract


def closing(d, mode="record"):
    """The closing check's summary and its failures, {(file, check): detail}."""
    summary = verify.verify(VerifyConfig(path=d, write_summary=False, closing_check=mode))
    return summary, {(c.file, c.name): c.detail for c in summary.checks if c.failed}


def rewrite_with_writer(d, i, edit):
    """Write data_i.pt again through extract's Writer (so its record is the writer's), after ``edit`` changed
    the loaded sample's dict in place."""
    s = formats.read_sample(d / f"data_{i}.pt")
    edit(s)
    writer = Writer(d, threads=1)
    writer.put([Sample(i, s["input_ids"], s["hidden_states"], s["loss_mask"])])
    writer.close()


def test_extract_closes_with_the_record_check_and_says_so(extracted_llama):
    """A default extract's summary says the record check ran, passed, and that `pipeline verify` re-reads."""
    summary = json.loads((extracted_llama / "summary.json").read_text())
    assert summary["ok"] is True and summary["schema_version"] == 1
    assert summary["stats"]["closing_check"] == "record"
    assert "`pipeline verify` re-reads every byte" in summary["stats"]["closing_check_note"]
    assert summary["stats"]["closing_check_seconds"] >= 0
    index = json.loads((extracted_llama / formats.CHECKSUMS).read_text())
    assert index["version"] == formats.CHECKSUM_VERSION == 2
    entry = index["files"]["data_0.pt"]
    assert entry["mtime_ns"] == (extracted_llama / "data_0.pt").stat().st_mtime_ns
    assert entry["facts"]["nonfinite"] == [0, 0, 0, 0] and len(entry["facts"]["log_rms"]) == 4
    names = {c["name"]: c["status"] for c in summary["checks"] if not c["file"]}
    assert names["unchanged"] == "ok" and names["layer_scale"] == "ok" and names["prepared_match"] == "ok"
    assert "checksum" not in names and "layer_order" not in names  # judged only by a full read


def test_record_check_passes_a_good_copy(states):
    summary, failed = closing(states)
    assert summary.ok and not failed, failed
    assert summary.stats["closing_check"] == "record"


def test_missing_file_is_named(states):
    (states / "data_3.pt").unlink()
    summary, failed = closing(states)
    assert not summary.ok and "data_3" in failed[(None, "contiguity")]


def test_truncated_file_is_named_by_its_size(states):
    p = states / "data_5.pt"
    os.truncate(p, p.stat().st_size // 2)
    _, failed = closing(states)
    assert "truncated" in failed[("data_5.pt", "unchanged")]


def test_file_replaced_after_the_write_is_named_by_its_mtime(states):
    """The same sample written again (same size, other mtime) is not what the writer recorded."""
    s = formats.read_sample(states / "data_2.pt")
    before = (states / "data_2.pt").stat()
    formats.write_sample(states / "data_2.pt", s["input_ids"], s["hidden_states"], s["loss_mask"])
    os.utime(states / "data_2.pt", ns=(before.st_atime_ns, before.st_mtime_ns + 1))
    assert (states / "data_2.pt").stat().st_size == before.st_size
    _, failed = closing(states)
    assert list(failed) == [("data_2.pt", "unchanged")] and "modified" in failed[("data_2.pt", "unchanged")]


def test_nonfinite_values_in_the_record_are_named_with_the_layer(states):
    """A file its writer wrote with a NaN (as a broken forward would): the record says so, by layer."""
    rewrite_with_writer(states, 4, lambda s: s["hidden_states"][1].__setitem__((0, 0), float("nan")))
    _, failed = closing(states)
    assert "hidden_states[1] (layer 4): 1" in failed[("data_4.pt", "nan_inf")]


def test_wrong_ids_in_the_record_are_named(states):
    """A file its writer was handed another row's tokens for (same length): prepared_match names it."""
    rewrite_with_writer(
        states, 6, lambda s: s["input_ids"].__setitem__(3, (int(s["input_ids"][3]) + 1) % 100)
    )
    _, failed = closing(states)
    assert list(failed) == [("data_6.pt", "prepared_match")]


def test_scale_from_the_record_is_judged_against_the_set(states):
    rewrite_with_writer(states, 7, lambda s: s["hidden_states"][2].mul_(100))
    _, failed = closing(states)
    assert "layer 5" in failed[("data_7.pt", "layer_scale")]


def test_full_check_catches_an_in_place_flip_the_record_check_cannot(states):
    """A byte flipped inside a state with size and mtime restored: by design only the full read sees it."""
    p = states / "data_8.pt"
    st, data = p.stat(), bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    record, _ = closing(states, "record")
    assert record.ok
    full, failed = closing(states, "full")
    assert full.stats["closing_check"] == "full" and full.stats["closing_check_note"].startswith("every byte")
    assert (
        "bytes differ" in failed[("data_8.pt", "checksum")]
        or "not what extract wrote" in failed[("data_8.pt", "checksum")]
    )


def test_an_old_set_falls_back_to_the_full_read_and_says_why(states):
    """A version 1 index (sha256 and bytes only) still verifies: read in full, the reason stated."""
    index = json.loads((states / formats.CHECKSUMS).read_text())
    index["version"] = 1
    index["files"] = {k: {"sha256": v["sha256"], "bytes": v["bytes"]} for k, v in index["files"].items()}
    (states / formats.CHECKSUMS).write_text(json.dumps(index))
    summary, failed = closing(states)
    assert summary.ok and not failed, failed
    assert summary.stats["closing_check"] == "full"
    assert (
        "24 of 24 files" in summary.stats["closing_check_note"]
        and "no writer's record" in summary.stats["closing_check_note"]
    )
    assert (
        summary.stats["checksums_recorded"] == 24
    )  # version 1 entries are read: the full read compares them


def test_resume_leaves_a_record_the_check_accepts(states, tiny_llama, prepared_llama):
    """Resume after files were lost, a record line lost and a file touched: the closing record check
    passes."""
    for i in (20, 21, 22, 23):
        (states / f"data_{i}.pt").unlink()
    index = json.loads((states / formats.CHECKSUMS).read_text())
    del index["files"]["data_9.pt"]  # a run killed between the rename and its journal line
    (states / formats.CHECKSUMS).write_text(json.dumps(index))
    os.utime(states / "data_0.pt")  # touched (same bytes): its record is taken again
    proc = run_extract(
        prepared_llama,
        tiny_llama,
        states,
        "--limit",
        24,
        "--no-progress",
        "--resume",
        check=True,
    )
    assert "recording the checksums of 2 files" in proc.stderr
    summary = json.loads((states / "summary.json").read_text())
    assert summary["ok"] is True and summary["stats"]["closing_check"] == "record"
    assert closing(states)[0].ok


def test_repair_leaves_a_record_the_check_accepts(states, tiny_llama, prepared_llama):
    """--resume --repair regenerates a damaged file; --closing-check full re-reads, and the record check
    accepts the repaired set too."""
    p = states / "data_5.pt"
    os.truncate(p, p.stat().st_size - 100)
    proc = run_extract(
        prepared_llama,
        tiny_llama,
        states,
        "--limit",
        24,
        "--no-progress",
        "--resume",
        "--repair",
        "--closing-check",
        "full",
        check=True,
    )
    assert "data_5.pt will be regenerated" in proc.stderr
    summary = json.loads((states / "summary.json").read_text())
    assert summary["ok"] is True and summary["stats"]["closing_check"] == "full"
    record, failed = closing(states)
    assert record.ok and record.stats["closing_check"] == "record", failed


def test_facts_of_written_tensors_match_what_a_read_finds(states):
    """The writer's facts are integrity's own figures for the file as read back (one judge, two inputs)."""
    s = formats.read_sample(states / "data_1.pt")
    facts = integrity.written_facts(s["input_ids"], s["hidden_states"], s["loss_mask"])
    recorded = formats.read_checksums(states)["data_1.pt"].facts
    assert facts == recorded
    assert facts["log_rms"] == [
        integrity.layer_profile.layer_stats(h).log_rms for h in s["hidden_states"]
    ]  # exactly
    zero = integrity.written_facts(
        s["input_ids"], [torch.zeros_like(h) for h in s["hidden_states"]], s["loss_mask"]
    )
    assert zero["log_rms"] == [None] * 4 and zero["nonfinite"] == [0] * 4


def test_facts_from_device_scales_equal_the_writers_own(states):
    """Facts from per-token scales (what the hf backend computes on the GPU) are the facts the writer computes
    from the states, non-finite entries included; the Writer records the scales it is handed."""
    s = formats.read_sample(states / "data_2.pt")
    ids, hs, mask = s["input_ids"], s["hidden_states"], s["loss_mask"]
    assert integrity.written_facts(
        ids, hs, mask, [integrity.layer_profile.token_scales(h) for h in hs]
    ) == integrity.written_facts(ids, hs, mask)
    bad = [h.clone() for h in hs]
    bad[1][3, :2] = float("nan")
    bad[2][0, 0] = float("inf")
    facts = integrity.written_facts(ids, bad, mask, [integrity.layer_profile.token_scales(h) for h in bad])
    assert facts == integrity.written_facts(ids, bad, mask) and facts["nonfinite"] == [0, 2, 1, 0]
    twice = [(rms * 2, count) for rms, count in (integrity.layer_profile.token_scales(h) for h in hs)]
    (states.parent / "handed").mkdir()
    writer = Writer(states.parent / "handed", threads=1)
    writer.put([Sample(0, ids, hs, mask, scales=twice)])
    writer.close()
    recorded = formats.read_checksums(states.parent / "handed")["data_0.pt"].facts["log_rms"]
    mine = integrity.written_facts(ids, hs, mask)["log_rms"]
    assert recorded == pytest.approx([x + math.log(2) for x in mine])


def test_resume_does_not_take_a_record_of_other_bytes(states, tiny_llama, prepared_llama):
    """A file replaced by one of the same tokens and size but other states, dated back before the records
    (which the resume check does not hash): resume keeps its old record, and the closing check names it."""
    p = states / "data_10.pt"
    s, before = formats.read_sample(p), p.stat()
    formats.write_sample(p, s["input_ids"], [h * 1.001 for h in s["hidden_states"]], s["loss_mask"])
    assert p.stat().st_size == before.st_size
    os.utime(p, ns=(before.st_atime_ns, before.st_mtime_ns - 1))
    proc = run_extract(
        prepared_llama,
        tiny_llama,
        states,
        "--limit",
        24,
        "--no-progress",
        "--resume",
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "data_10.pt: unchanged: modified since extract wrote it" in proc.stderr


def test_a_damaged_record_entry_is_named_not_a_crash(states):
    """A record entry whose facts lack a field (damaged, or another tool's) fails as `record`, naming the
    file."""
    index = json.loads((states / formats.CHECKSUMS).read_text())
    del index["files"]["data_0.pt"]["facts"]["ids_mask_sha256"]
    (states / formats.CHECKSUMS).write_text(json.dumps(index))
    _, failed = closing(states)
    assert list(failed) == [("data_0.pt", "record")] and "pipeline verify" in failed[("data_0.pt", "record")]
