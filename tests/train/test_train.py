"""The train stage on small real inputs: checkpoints, layer-id convention, metrics, resume, acceptance."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from pipeline.train.files import read_metrics
from pipeline.train.stage import run


def test_checkpoint_per_epoch_and_export(trained):
    """Every epoch leaves a complete checkpoint dir; the final draft is exported in bf16."""
    _, cfg, summary = trained
    ckpt = cfg.out / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["0", "1", "2", "3"]
    for epoch in range(4):
        names = {p.name for p in (ckpt / str(epoch)).iterdir()}
        assert {
            "config.json",
            "model.safetensors",
            "optimizer_state_dict.pt",
            "scheduler_state_dict.pt",
        } <= names
        assert load_file(str(ckpt / str(epoch) / "model.safetensors"))["fc.weight"].dtype == torch.float32
    draft = load_file(str(cfg.out / "draft" / "model.safetensors"))
    assert draft["fc.weight"].dtype == torch.bfloat16 and draft["d2t"].dtype == torch.int64
    assert summary["complete"] and summary["draft"] == str(cfg.out / "draft")


def test_layer_id_convention_in_saved_config(trained):
    """The saved config carries vLLM's ids: captured layer OUTPUT k becomes layer INPUT k+1, last layer
    dropped."""
    inputs, cfg, _ = trained
    saved = json.loads((cfg.out / "draft" / "config.json").read_text())
    captured = list(inputs.layer_ids)  # (2, 4, 5, 7) for 8 layers
    assert saved["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6] == [k + 1 for k in captured[:-1]]
    assert saved["draft_vocab_size"] == inputs.draft_vocab
    assert saved["transformer_layer_config"]["vocab_size"] == inputs.vocab
    assert saved["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == cfg.ttt_steps
    record = json.loads((cfg.out / "train_config.json").read_text())
    assert record["layer_ids"] == captured and record["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6]


def test_metrics_log_loss_and_per_step_accuracy(trained):
    """metrics.jsonl has one row per step with the loss and the accuracy of each TTT step, plus validation
    rows."""
    _, cfg, summary = trained
    rows = read_metrics(cfg.out / "metrics.jsonl")
    train = [r for r in rows if "train" in r]
    val = [r for r in rows if "val" in r]
    steps_per_epoch = summary["train"]["steps_per_epoch"]
    assert [r["step"] for r in train] == list(range(4 * steps_per_epoch))
    for j in range(cfg.ttt_steps):
        assert {f"loss_{j}", f"full_acc_{j}", f"cond_acc_{j}"} <= set(train[0]["train"])
    assert len(val) == 4 and "loss_epoch" in val[0]["val"]
    assert train[-1]["train"]["loss"] < train[0]["train"]["loss"]


def test_summary_says_where_the_runs_time_went(trained):
    """phase_seconds splits the run's wall time: each phase a non-negative figure, the training phase at
    least its epochs plus their validations and checkpoints (parts of it), an offline run no states phase."""
    _, _, summary = trained
    tr = summary["train"]
    ph = tr["phase_seconds"]
    assert list(ph) == [
        "setup",
        "training",
        "training_validation",
        "training_checkpoints",
        "export",
        "evaluation",
    ], ph
    assert all(v >= 0 for v in ph.values()), ph
    parts = tr["train_seconds"] + ph["training_validation"] + ph["training_checkpoints"]
    assert ph["training"] >= parts - 0.01 and ph["training_validation"] > 0 and ph["training_checkpoints"] > 0


def test_trained_draft_beats_trivial_baselines(trained):
    """On inputs with learnable structure the trained draft's acceptance length beats every trivial
    baseline."""
    _, cfg, summary = trained
    ev = summary["eval"]
    assert ev["beats_baseline"], ev
    assert ev["draft"]["acceptance_length"] > 1.2
    assert set(ev["baselines"]) == {
        "untrained_draft",
        "unigram_target",
        "most_frequent_token",
        "ngram_context",
    }
    assert json.loads((cfg.out / "eval.json").read_text()) == json.loads(json.dumps(ev))


def test_plots_are_pngs(trained):
    """The loss curve and per-position acceptance plots are written as PNG files."""
    _, cfg, _ = trained
    for name in ("loss.png", "acceptance.png"):
        data = (cfg.out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_resume_equals_uninterrupted_run(make_inputs, tmp_path):
    """Stopping after epoch 0 and resuming gives bit-identical weights and optimizer state to one run."""
    inputs = make_inputs()
    straight = inputs.config(tmp_path / "straight", epochs=2, evaluate=False)
    run(straight, log=lambda m: None)
    part = inputs.config(tmp_path / "resumed", epochs=2, evaluate=False, stop_after_epochs=1)
    first = run(part, log=lambda m: None)
    assert first["complete"] is False and sorted(p.name for p in (part.out / "checkpoints").iterdir()) == [
        "0"
    ]
    run(inputs.config(tmp_path / "resumed", epochs=2, evaluate=False, resume=True), log=lambda m: None)
    a = load_file(str(straight.out / "checkpoints" / "1" / "model.safetensors"))
    b = load_file(str(part.out / "checkpoints" / "1" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    oa = torch.load(straight.out / "checkpoints" / "1" / "optimizer_state_dict.pt", weights_only=True)
    ob = torch.load(part.out / "checkpoints" / "1" / "optimizer_state_dict.pt", weights_only=True)
    for key, state in oa["state"].items():
        assert all(torch.equal(state[n], ob["state"][key][n]) for n in state)
    steps = [r["step"] for r in read_metrics(part.out / "metrics.jsonl") if "train" in r]
    assert steps == sorted(set(steps)), "resumed run re-logged or skipped step numbers"


def test_different_seed_changes_weights(make_inputs, tmp_path):
    """The seed matters: the resume equality above is not two untouched models compared."""
    inputs = make_inputs()
    run(inputs.config(tmp_path / "s0", epochs=1, evaluate=False), log=lambda m: None)
    run(inputs.config(tmp_path / "s1", epochs=1, evaluate=False, seed=1), log=lambda m: None)
    a = load_file(str(tmp_path / "s0" / "checkpoints" / "0" / "model.safetensors"))
    b = load_file(str(tmp_path / "s1" / "checkpoints" / "0" / "model.safetensors"))
    assert not torch.equal(a["fc.weight"], b["fc.weight"])


def _checkpoint(root, name, step):
    d = root / name
    d.mkdir(parents=True)
    (d / "training_state.json").write_text(json.dumps({"global_step": step}))
    (d / "model.safetensors").write_bytes(b"w" * 64)


def _step(ckpt, epoch):
    return json.loads((ckpt / str(epoch) / "training_state.json").read_text())["global_step"]


@pytest.mark.parametrize("cut", ["staged", "old_aside", "new_in", "done"])
def test_a_kill_anywhere_in_a_checkpoint_replacement_leaves_one_whole_checkpoint(tmp_path, cut):
    """`replace_checkpoint` uses renames only; whatever instant a kill cuts it at (reproduced by doing its
    steps up to ``cut``), `settle_checkpoints` leaves epoch 1 whole: the old save before the new one is
    renamed in, the new one after, and no staging or aside directory."""
    from pipeline.train.files import CHECKPOINTS
    from pipeline.train.trainer import last_epoch, replace_checkpoint, settle_checkpoints

    ckpt = tmp_path / CHECKPOINTS
    _checkpoint(ckpt, "0", 4)
    _checkpoint(ckpt, "1", 6)
    _checkpoint(ckpt / ".staging", "1", 7)
    if cut == "old_aside":
        os.replace(ckpt / "1", ckpt / ".replaced-1")
    elif cut == "new_in":
        os.replace(ckpt / "1", ckpt / ".replaced-1")
        os.replace(ckpt / ".staging" / "1", ckpt / "1")
    elif cut == "done":
        replace_checkpoint(ckpt, 1)
    settle_checkpoints(tmp_path)
    assert sorted(p.name for p in ckpt.iterdir()) == ["0", "1"]
    assert last_epoch(tmp_path) == 1
    assert _step(ckpt, 1) == (7 if cut in ("new_in", "done") else 6)
    assert sorted(p.name for p in (ckpt / "1").iterdir()) == ["model.safetensors", "training_state.json"]
