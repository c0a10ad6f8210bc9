"""`python -m pipeline train` then `python -m pipeline verify` on the real stages' output for the tiny
Llama."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_pipeline

pytestmark = pytest.mark.slow


def test_train_then_verify_on_real_stage_outputs(tiny_run, tiny_llama, tmp_path):
    """The train CLI trains on real extracted states, prints the acceptance table, and verify passes the
    draft."""
    out = tmp_path / "train"
    proc = run_pipeline(
        "train",
        "--data",
        tiny_run / "hidden_states",
        "--prepared",
        tiny_run / "prepared",
        "--verifier",
        tiny_run / "verifier",
        "--out",
        out,
        "--epochs",
        3,
        "--lr",
        1e-3,
        "--max-len",
        512,
        "--device",
        "cpu",
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "offline acceptance" in proc.stdout and "beats the best trivial baseline" in proc.stdout, (
        proc.stdout
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval"]["beats_baseline"] and summary["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6]
    assert (out / "loss.png").is_file() and (out / "acceptance.png").is_file()
    saved = json.loads((out / "draft" / "config.json").read_text())
    assert saved["speculators_config"]["verifier"]["name_or_path"] == str(tiny_llama.resolve())
    verify = run_pipeline("verify", out / "draft")
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-2000:]
    assert "acceptance" in verify.stdout
    assert f"pipeline evaluate --model TARGET --draft {out / 'draft'}" in verify.stderr  # the gate
