"""Bad train inputs are rejected with a one-line error before any training step."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pipeline.ondisk import formats
from pipeline.errors import StageError
from pipeline.train.inputs import check_inputs, split_indices
from pipeline.train.stage import run


def _assert_rejected(cfg, *fragments: str) -> str:
    with pytest.raises(StageError) as info:
        run(cfg, log=lambda m: None)
    msg = str(info.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg
    assert not (cfg.out / "checkpoints").exists(), "a checkpoint was written although the input was bad"
    assert not (cfg.out / "metrics.jsonl").exists(), "a training step ran although the input was bad"
    return msg


def test_three_captured_layers_rejected(make_inputs, tmp_path):
    """Samples with 3 captured hidden-state tensors instead of 4 stop the run before training."""
    inputs = make_inputs(captured=3)
    _assert_rejected(inputs.config(tmp_path / "out"), "3 captured hidden-state tensors", "needs 4")


def test_three_layer_ids_in_data_config_rejected(make_inputs, tmp_path):
    """A data_config.json listing 3 layer ids is rejected."""
    inputs = make_inputs()
    dc = formats.read_data_config(inputs.data)
    dc.layer_ids = dc.layer_ids[1:]
    formats.write_data_config(inputs.data, dc)
    _assert_rejected(inputs.config(tmp_path / "out"), "3 layer ids", "needs 4")


def test_d2t_not_matching_draft_vocab_rejected(make_inputs, tmp_path):
    """A d2t whose length differs from the draft vocab size asked for is rejected."""
    inputs = make_inputs()
    _assert_rejected(
        inputs.config(tmp_path / "out", draft_vocab_size=inputs.draft_vocab + 8),
        "len(d2t) = 64",
        "draft vocab size is 72",
    )


def test_d2t_t2d_disagreeing_rejected(make_inputs, tmp_path):
    """A t2d that selects more target ids than d2t has entries is rejected."""
    inputs = make_inputs()
    d2t, t2d = formats.read_vocab(inputs.prepared)
    t2d = t2d.copy()
    t2d[-1] = True
    formats.write_vocab(inputs.prepared, d2t, t2d)
    _assert_rejected(inputs.config(tmp_path / "out"), "t2d.sum() = 65 but len(d2t) = 64")


def test_t2d_for_another_target_vocab_rejected(make_inputs, tmp_path):
    """A t2d sized for another target vocabulary is rejected."""
    inputs = make_inputs()
    d2t, _ = formats.read_vocab(inputs.prepared)
    t2d = np.zeros(inputs.vocab * 2, dtype=bool)
    t2d[: len(d2t)] = True
    formats.write_vocab(inputs.prepared, d2t, t2d)
    _assert_rejected(
        inputs.config(tmp_path / "out"),
        f"len(t2d) = {inputs.vocab * 2}",
        f"target vocab size is {inputs.vocab}",
    )


def test_hidden_size_mismatch_rejected(make_inputs, tmp_path):
    """Verifier weights of another hidden size than the hidden states are rejected, naming both sizes."""
    inputs = make_inputs(verifier_hidden=96)
    _assert_rejected(
        inputs.config(tmp_path / "out"),
        "hidden size mismatch",
        "data_config.json 64",
        "verifier embed_tokens 96",
    )


def test_missing_sample_rejected(make_inputs, tmp_path):
    """A gap in data_{i}.pt numbering is rejected."""
    inputs = make_inputs()
    formats.data_file(inputs.data, 3).unlink()
    _assert_rejected(inputs.config(tmp_path / "out"), "not numbered 0..N-1")


def test_nonempty_out_needs_resume_or_overwrite(make_inputs, tmp_path):
    """An existing output dir is neither reused nor clobbered without --resume or --overwrite."""
    inputs = make_inputs()
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    _assert_rejected(inputs.config(out), "--resume", "--overwrite")
    assert (out / "keep.txt").read_text() == "x"


def test_split_is_seeded_and_disjoint():
    """The held-out split depends only on the seed, covers all samples and never is empty."""
    a = split_indices(20, 0.25, 7)
    assert a == split_indices(20, 0.25, 7)
    assert a != split_indices(20, 0.25, 8)
    train, held = a
    assert sorted(train + held) == list(range(20)) and len(held) == 5
    assert split_indices(2, 0.01, 0) == ([1], [0]) or split_indices(2, 0.01, 0) == ([0], [1])


@pytest.mark.parametrize("n", [2, 10, 19, 1500, 1501])
def test_held_out_last_is_speculators_split_of_the_exported_rows(n):
    """--held-out last holds out what `speculators train --train-data-ratio 1-F` validates on: its
    ArrowDataset's rows from int(n * ratio) (read in its source here, so a change there fails this test);
    export-speculators writes sample i as row i."""
    import inspect

    from speculators.train.data import ArrowDataset

    assert "split_idx = int(len(self.data) * train_ratio)" in inspect.getsource(ArrowDataset.__init__)
    train, held = split_indices(n, 0.1, 7, held_out="last")
    boundary = max(1, min(n - 1, int(n * 0.9)))
    assert train == list(range(boundary)) and held == list(range(boundary, n))
    assert split_indices(n, 0.1, 8, held_out="last") == (train, held)  # the seed plays no part


def test_good_inputs_pass(make_inputs, tmp_path):
    """Consistent inputs pass the checks and give vLLM's layer ids."""
    inputs = make_inputs()
    checked = check_inputs(inputs.config(tmp_path / "out"))
    assert checked.layer_ids == list(inputs.layer_ids)
    assert checked.vllm_aux_layer_ids == [k + 1 for k in inputs.layer_ids[:-1]]
    assert len(checked.eval_files) == 3 and len(checked.train_files) == 9


def test_cli_bad_input_exit_code_and_one_line(make_inputs, tmp_path):
    """`python -m pipeline train` on bad input exits 2 with one `error:` line naming the problem."""
    inputs = make_inputs(captured=3)
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "train",
            "--data",
            str(inputs.data),
            "--verifier",
            str(inputs.verifier),
            "--prepared",
            str(inputs.prepared),
            "--model",
            str(inputs.model),
            "--out",
            str(out),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "captured hidden-state tensors" in errors[0], proc.stderr
    assert not (out / "checkpoints").exists()


def test_resume_with_other_inputs_rejected(make_inputs, tmp_path):
    """--resume refuses to continue a run whose model shape or split would change."""
    inputs = make_inputs()
    out = tmp_path / "out"
    run(inputs.config(out, epochs=2, evaluate=False, stop_after_epochs=1), log=lambda m: None)
    with pytest.raises(StageError, match="ttt_steps differ"):
        run(inputs.config(out, epochs=2, evaluate=False, resume=True, ttt_steps=2), log=lambda m: None)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["0"]


_CUSTOM_CONFIG = """
from transformers import PretrainedConfig


class WrappedConfig(PretrainedConfig):
    model_type = "pipeline_test_wrapped"
    attribute_map = {"num_attention_heads": "n_heads"}

    def __init__(self, n_heads=2, **kwargs):
        self.n_heads = n_heads
        super().__init__(**kwargs)
"""


def test_trust_remote_code_reads_the_target_config_through_its_own_code(make_inputs, tmp_path):
    """A target whose config.json needs its own code (an attribute alias) trains only with
    --trust-remote-code."""
    import json

    inputs = make_inputs()
    raw = json.loads((inputs.model / "config.json").read_text())
    del raw["num_attention_heads"]  # only the custom class knows: n_heads, aliased, default 2
    raw.update(
        model_type="pipeline_test_wrapped", auto_map={"AutoConfig": "configuration_wrapped.WrappedConfig"}
    )
    (inputs.model / "config.json").write_text(json.dumps(raw))
    (inputs.model / "configuration_wrapped.py").write_text(_CUSTOM_CONFIG)
    with pytest.raises(StageError, match="lacks what the draft needs"):
        check_inputs(inputs.config(tmp_path / "out"))
    checked = check_inputs(inputs.config(tmp_path / "out", trust_remote_code=True))
    assert checked.target.num_attention_heads == 2 and checked.target.num_layers == 8
