"""`pipeline verify` on draft checkpoints: sound ones pass, broken ones fail with the reason."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from pipeline.train.checkpoint_checks import verify_checkpoint


def _copy_run(trained, tmp_path):
    _, cfg, _ = trained
    dst = tmp_path / "run"
    shutil.copytree(cfg.out, dst)
    return dst


def _status(summary) -> dict[str, str]:
    return {c.name: c.status for c in summary.checks}


def test_trained_run_passes_every_check(trained):
    """A complete train output verifies clean, through its dir, its draft/ and an epoch checkpoint."""
    _, cfg, summary = trained
    for path in (cfg.out, cfg.out / "draft", cfg.out / "checkpoints" / "3"):
        s = verify_checkpoint(path)
        assert s.ok, [c for c in s.checks if c.status != "ok"]
    s = verify_checkpoint(cfg.out)
    status = _status(s)
    assert (
        status["aux_layer_ids"] == status["acceptance"] == status["vocab_mapping"] == status["finite"] == "ok"
    )
    assert status["draft_vocab_coverage"] == "ok"
    assert s.stats["acceptance_length"] == round(summary["eval"]["draft"]["acceptance_length"], 4)


def test_wrong_layer_convention_fails(trained, tmp_path):
    """A draft whose aux ids are the captured ids themselves (not +1) fails the layer-id check."""
    run = _copy_run(trained, tmp_path)
    cfg_path = run / "draft" / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["eagle_aux_hidden_state_layer_ids"] = [k - 1 for k in raw["eagle_aux_hidden_state_layer_ids"]]
    cfg_path.write_text(json.dumps(raw))
    s = verify_checkpoint(run)
    bad = [c for c in s.failures if c.name == "aux_layer_ids"]
    assert bad and "vLLM needs [3, 5, 6]" in bad[0].detail


def test_nan_weights_fail(trained, tmp_path):
    """A NaN in the draft weights fails the finite check, naming the tensor."""
    run = _copy_run(trained, tmp_path)
    w = load_file(str(run / "draft" / "model.safetensors"))
    w["fc.weight"][0, 0] = float("nan")
    save_file(w, str(run / "draft" / "model.safetensors"), metadata={"format": "pt"})
    s = verify_checkpoint(run)
    assert [c.detail for c in s.failures if c.name == "finite"] == ["NaN/Inf in fc.weight"]


def test_broken_vocab_mapping_fails(trained, tmp_path):
    """A t2d that disagrees with d2t fails the vocab-mapping check."""
    run = _copy_run(trained, tmp_path)
    w = load_file(str(run / "draft" / "model.safetensors"))
    w["t2d"] = torch.ones_like(w["t2d"])
    save_file(w, str(run / "draft" / "model.safetensors"), metadata={"format": "pt"})
    s = verify_checkpoint(run)
    assert any(c.name == "vocab_mapping" for c in s.failures)


def test_draft_not_beating_baseline_fails(trained, tmp_path):
    """A run whose draft does not beat the trivial baselines fails verification."""
    run = _copy_run(trained, tmp_path)
    ev = json.loads((run / "eval.json").read_text())
    ev["beats_baseline"] = False
    (run / "eval.json").write_text(json.dumps(ev))
    assert any(c.name == "acceptance" for c in verify_checkpoint(run).failures)


def test_not_a_checkpoint(tmp_path):
    """A directory without the draft files fails with one check saying what is missing."""
    s = verify_checkpoint(tmp_path)
    assert not s.ok and s.failures[0].name == "files"


def test_low_draft_vocab_coverage_warns(trained, tmp_path):
    """When the target's greedy tokens mostly fall outside the draft vocab, verify warns and says why."""
    run = _copy_run(trained, tmp_path)
    ev = json.loads((run / "eval.json").read_text())
    ev["greedy_in_draft_vocab"] = 0.003
    (run / "eval.json").write_text(json.dumps(ev))
    c = next(c for c in verify_checkpoint(run).checks if c.name == "draft_vocab_coverage")
    assert c.status == "warn" and "0.3%" in c.detail and "--draft-vocab-size" in c.detail


def test_full_vocab_draft_passes_without_mapping_and_fails_with_one(make_inputs, tmp_path):
    """A full-vocab draft verifies without d2t/t2d; a stray d2t (what vLLM cannot load) fails the vocab
    check."""
    import numpy as np

    from pipeline.train import draft as draft_mod
    from pipeline.train.inputs import check_inputs

    inputs = make_inputs(draft_vocab=96)
    checked = check_inputs(inputs.config(tmp_path / "unused"))
    view = draft_mod.write_verifier_view(tmp_path / "view", checked.verifier, checked.target)
    config = draft_mod.build_speculator_config(
        target=checked.target,
        verifier_view=view,
        draft_vocab_size=96,
        vllm_aux_layer_ids=checked.vllm_aux_layer_ids,
        ttt_steps=3,
    )
    draft_mod.new_draft(config, checked.d2t, checked.t2d).save_pretrained(tmp_path / "draft")
    s = verify_checkpoint(tmp_path / "draft")
    assert _status(s)["shapes"] == "ok" and "vocab_mapping" not in _status(s), s.checks
    w = load_file(str(tmp_path / "draft" / "model.safetensors"))
    w["d2t"] = torch.from_numpy(np.zeros(96, dtype=np.int64))
    save_file(w, str(tmp_path / "draft" / "model.safetensors"), metadata={"format": "pt"})
    bad = [c.detail for c in verify_checkpoint(tmp_path / "draft").failures if c.name == "vocab_mapping"]
    assert bad and "draft_id_to_target_id" in bad[0]
