"""Config vs checkpoint before the model runs (layers claimed vs layers with weights, tied embeddings vs an
lm_head), and numbers refused at the boundary with their allowed range (zero, negative, NaN, absurd)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.pipeline.test_reliability_readers import _config, _tiny_names, cli, linked_copy, refused


def _model(tmp_path, tiny_llama, **config):
    model = linked_copy(tiny_llama, tmp_path / "model", "config.json")
    (model / "config.json").write_bytes(_config(tiny_llama, **config))
    return model


LAYERS = {
    "config-claims-more-layers": ({"num_hidden_layers": 10}, None, "no weights for layers 8, 9"),
    "config-claims-fewer-layers": ({"num_hidden_layers": 7}, None, "weights for layer 7 that config.json"),
    "checkpoint-lacks-a-layer": ({}, 3, "no weights for layer 3"),
}


@pytest.mark.parametrize("stage", ["extract", "weights"])
@pytest.mark.parametrize("case", sorted(LAYERS))
def test_config_and_checkpoint_layers_must_agree(
    tmp_path, monkeypatch, capsys, tiny_llama, prepared_llama, stage, case
):
    """A config claiming layers the checkpoint lacks (randomly initialised), or leaving layers unused, is
    refused before the model loads; nothing is written."""
    config, hole, fragment = LAYERS[case]
    model = _model(tmp_path, tiny_llama, **config)
    if hole is not None:  # an index that leaves out every tensor of one layer
        names = [n for n in _tiny_names(tiny_llama) if f".layers.{hole}." not in n]
        (model / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": dict.fromkeys(names, "model.safetensors")})
        )
    out = tmp_path / "out"
    args = {"extract": ["--prepared", prepared_llama, "--no-progress"], "weights": []}[stage]
    refused(cli(monkeypatch, capsys, stage, "--model", model, "--out", out, *args), fragment)
    assert not out.exists()


def test_declared_multi_token_prediction_layers_are_not_unused(tmp_path, monkeypatch, capsys, tiny_llama):
    """Layers past num_hidden_layers that num_nextn_predict_layers declares (DeepSeek/Kimi MTP) are
    accepted."""
    model = _model(tmp_path, tiny_llama, num_hidden_layers=7, num_nextn_predict_layers=1)
    rc, err = cli(monkeypatch, capsys, "weights", "--model", model, "--out", tmp_path / "v")
    assert rc == 0, err


def _with_lm_head(tmp_path, tiny_llama, same: bool):
    """A model whose config ties embeddings, and whose checkpoint also holds an lm_head (equal or not)."""
    from safetensors.torch import load_file, save_file

    model = _model(tmp_path, tiny_llama, tie_word_embeddings=True)
    (model / "model.safetensors").unlink()
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    if same:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(model / "model.safetensors"))
    return model


TIED_ARGS = {"weights": [], "extract": ["--limit", "2", "--no-verify", "--no-progress"]}


@pytest.mark.parametrize("stage", sorted(TIED_ARGS))
def test_tied_config_with_a_different_lm_head_is_refused(
    tmp_path, monkeypatch, capsys, tiny_llama, prepared_llama, stage
):
    """tie_word_embeddings: true plus a distinct lm_head.weight would give a verifier the target never
    computes (weights), or capture states of a target that is not the checkpoint's (extract): refused before
    the model runs."""
    model = _with_lm_head(tmp_path, tiny_llama, same=False)
    extra = ["--prepared", prepared_llama] if stage == "extract" else []
    refused(
        cli(monkeypatch, capsys, stage, "--model", model, "--out", tmp_path / "v", *extra, *TIED_ARGS[stage]),
        "tie_word_embeddings: true",
        "differs from model.embed_tokens.weight",
    )
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize("stage", sorted(TIED_ARGS))
def test_tied_config_with_an_equal_lm_head_is_accepted(
    tmp_path, monkeypatch, capsys, tiny_llama, prepared_llama, stage
):
    """A tied checkpoint that also saved its lm_head (the same values) is what the target computes:
    accepted."""
    model = _with_lm_head(tmp_path, tiny_llama, same=True)
    extra = ["--prepared", prepared_llama] if stage == "extract" else []
    rc, err = cli(
        monkeypatch, capsys, stage, "--model", model, "--out", tmp_path / "v", *extra, *TIED_ARGS[stage]
    )
    assert rc == 0, err


def test_verify_with_a_tied_model_holding_a_different_lm_head_fails_naming_it(
    tmp_path, monkeypatch, capsys, tiny_llama, extracted_llama
):
    """verify --model runs the config-vs-checkpoint check before it loads the target: a failed check naming
    the tied lm_head (exit 3), not an alignment figure computed with a head the target never uses."""
    model = _with_lm_head(tmp_path, tiny_llama, same=False)
    states = tmp_path / "states"
    shutil.copytree(extracted_llama, states)
    refused(
        cli(monkeypatch, capsys, "verify", states, "--model", model, "--recompute-samples", "1"),
        "recompute",
        "tie_word_embeddings: true",
        code=3,
    )


NUMBERS = {
    "prepare-max-samples-0": (
        "prepare",
        ["--max-samples", "0"],
        "--max-samples 0 is outside the allowed range (at least 1)",
    ),
    "prepare-max-samples-negative": ("prepare", ["--max-samples", "-3"], "--max-samples -3 is outside"),
    "prepare-seq-length-absurd": ("prepare", ["--seq-length", "1000000000"], "(2..1048576)"),
    "extract-limit-negative": (
        "extract",
        ["--limit", "-1"],
        "--limit -1 is outside the allowed range (at least 1)",
    ),
    "extract-tensor-parallel-0": (
        "extract",
        ["--tensor-parallel-size", "0"],
        "--tensor-parallel-size 0 is outside",
    ),
    "verify-min-agreement-nan": (
        "verify",
        ["--min-agreement", "nan"],
        "--min-agreement nan is outside the allowed range (0.0..1.0)",
    ),
    "verify-min-agreement-above-1": ("verify", ["--min-agreement", "1.5"], "--min-agreement 1.5 is outside"),
    "verify-min-agreement-inf": ("verify", ["--min-agreement", "-inf"], "--min-agreement -inf is outside"),
    "verify-alignment-samples-0": (
        "verify",
        ["--alignment-samples", "0"],
        "--alignment-samples 0 is outside",
    ),
    "verify-world-size-0": ("verify", ["--world-size", "0"], "--world-size 0 is outside"),
    "verify-rank-beyond-world": (
        "verify",
        ["--world-size", "2", "--rank", "5"],
        "--rank 5 is outside the allowed range (0..1)",
    ),
    "verify-rank-negative": ("verify", ["--rank", "-1"], "--rank -1 is outside"),
}


@pytest.mark.parametrize("case", sorted(NUMBERS))
def test_numbers_outside_their_range_are_refused_at_the_boundary(
    tmp_path, monkeypatch, capsys, tiny_llama, conversations, prepared_llama, extracted_llama, case
):
    """Zero, negative, non-finite or absurd numbers: one line with the allowed range, exit 2, nothing
    written."""
    stage, flags, fragment = NUMBERS[case]
    out = tmp_path / "out"
    args = {
        "prepare": ["--data", conversations, "--model", tiny_llama, "--out", out],
        "extract": ["--prepared", prepared_llama, "--model", tiny_llama, "--out", out, "--no-progress"],
        "verify": [extracted_llama],
    }[stage]
    before = (extracted_llama / "summary.json").stat().st_mtime_ns
    refused(cli(monkeypatch, capsys, stage, *args, *flags), fragment)
    assert not out.exists()
    assert (extracted_llama / "summary.json").stat().st_mtime_ns == before


def test_verify_of_a_shard_that_selects_no_file_fails(monkeypatch, capsys, extracted_llama):
    """verify --world-size 100 --rank 99 of a 24-sample set checks nothing: a failed check, not OK."""
    refused(
        cli(monkeypatch, capsys, "verify", extracted_llama, "--world-size", "100", "--rank", "99"),
        "selects none of the 24 samples",
        code=3,
    )
    assert cli(monkeypatch, capsys, "verify", extracted_llama)[0] == 0  # summary.json back to the whole set's
