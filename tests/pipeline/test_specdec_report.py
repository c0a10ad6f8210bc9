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
    assert line.endswith("greedy output differs for eagle3 k=2")
