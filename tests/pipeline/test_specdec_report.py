"""pipeline/specdec/report.py's arithmetic on engine results shaped as measure.run_engine writes them: the
speed-ups against the mean of the bracketing no-speculation engines, their drift, greedy equality against the
first. The same on real engines: tests/train/test_vllm_draft.py."""

from __future__ import annotations

import pytest

from pipeline.evaluate import verdict
from pipeline.specdec import report


def result(name: str, tps: float, tokens, k: int = 0, again: bool = False, accepted: int = 0) -> dict:
    counters = {
        "vllm:spec_decode_num_drafts": 10 if k else 0,
        "vllm:spec_decode_num_accepted_tokens": accepted,
    }
    phase = {"tokens": tokens, "output_tokens": sum(map(len, tokens)), "output_tokens_per_s": tps}
    return {
        "method": {"name": name, "k": k, "again": again},
        "phases": {"batch1": {**phase, "counters": counters}},
    }


def test_speedups_are_against_the_mean_of_both_no_speculation_runs_and_their_drift_is_told():
    results = [
        result("none", 100.0, [[1, 2, 3]]),
        result("eagle3", 240.0, [[1, 2, 3]], k=3, accepted=12),
        result("none", 140.0, [[1, 2, 3]], again=True),
    ]
    table = {r["label"]: r for r in report.rows(results)}
    assert set(table) == {"none", "eagle3 k=3", "none again"}
    assert table["eagle3 k=3"]["speedup"] == pytest.approx(2.0)  # 240 / mean(100, 140)
    assert table["none"]["speedup"] == pytest.approx(100 / 120) and table["none again"]["speedup"] > 1
    assert table["eagle3 k=3"]["acceptance_length"] == pytest.approx(2.2)
    moved = report.drift(results)
    assert moved == {"batch1": pytest.approx(0.4)}
    line = verdict(list(table.values()), moved)
    assert "2.00x no speculation" in line and "moved 40% between its runs" in line
    assert "greedy output equal" in line


def test_one_no_speculation_run_has_no_drift_and_an_unequal_answer_is_named():
    results = [result("none", 100.0, [[1, 2]]), result("eagle3", 150.0, [[1, 9]], k=2, accepted=5)]
    table = report.rows(results)
    assert report.drift(results) == {}
    assert [r["greedy_equal"] for r in table] == [True, False]
    line = verdict(table, {})
    assert "1.50x no speculation" in line and "moved" not in line
    # without batch-invariant kernels the line says rounding may be the cause, and how to tell
    assert "greedy output differs for eagle3 k=2 (vLLM's kernels are not batch-invariant" in line
    assert "--batch-invariant" in line
    assert verdict(table, {}, batch_invariant=True).endswith("greedy output differs for eagle3 k=2")


def test_batch_invariant_engines_get_vllms_switch_in_their_environment(monkeypatch):
    from pipeline.specdec.measure import Engine

    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    plain = Engine(target="m", max_tokens=8, max_model_len=64, env={"A": "1"})
    assert "VLLM_BATCH_INVARIANT" not in plain.child_env() and plain.child_env()["A"] == "1"
    assert (
        Engine(target="m", max_tokens=8, max_model_len=64, batch_invariant=True).child_env()[
            "VLLM_BATCH_INVARIANT"
        ]
        == "1"
    )


def test_decode_speedup_is_the_time_per_output_token_against_the_no_speculation_engines_mean():
    """Batch 1 holds two figures: output tok/s over whole requests (prefill and the first token in it) and the
    decode rate after the first token (TPOT); each against the mean of the bracketing none engines."""
    results = [
        result("none", 100.0, [[1, 2, 3]]),
        result("eagle3", 180.0, [[1, 2, 3]], k=4, accepted=13),
        result("none", 100.0, [[1, 2, 3]], again=True),
    ]
    for r, tpot in zip(results, (5.0, 2.4, 4.6), strict=True):
        r["phases"]["batch1"]["tpot_ms"] = tpot
    table = {r["label"]: r for r in report.rows(results)}
    assert table["eagle3 k=4"]["decode_speedup"] == pytest.approx(4.8 / 2.4)
    assert table["eagle3 k=4"]["speedup"] == pytest.approx(1.8)
    line = verdict(list(table.values()), report.drift(results))
    assert "1.80x no speculation (2.00x per output token after the first)" in line
    md = report.markdown(list(table.values()))
    assert "| decode speed-up |" in md and "| 2.00x |" in md


def test_without_tpot_there_is_no_decode_speedup():
    table = report.rows([result("none", 100.0, [[1]]), result("ngram", 120.0, [[1]], k=3, accepted=1)])
    assert [r["decode_speedup"] for r in table] == [None, None]
    assert "| - |" in report.markdown(table)
