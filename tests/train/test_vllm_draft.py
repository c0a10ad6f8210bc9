"""vLLM 0.16.0 (CPU build) accepts a draft trained by `pipeline train` as an EAGLE-3 speculative config.

Runs in .venv-vllm (`make test-vllm`); elsewhere the vLLM import fails the test. Serving the draft needs a
GPU (vLLM's CPU engine refuses speculative decoding), so this checks what vLLM decides before serving:
the draft's architecture, its auxiliary layer ids and vocab size, and the target `vllm serve DRAFT` picks.
"""

from __future__ import annotations

import json

import pytest

from pipeline.train import TrainConfig, run

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def trained_draft(tiny_run, tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-draft") / "train"
    cfg = TrainConfig(data=tiny_run / "hidden_states", verifier=tiny_run / "verifier", out=out, model=tiny_llama,
                      prepared=tiny_run / "prepared", epochs=1, max_len=256, device="cpu", evaluate=False, plots=False)
    run(cfg, log=lambda m: None)
    return out / "draft"


def _engine_config(**kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(max_model_len=256, enforce_eager=True, dtype="float32", **kwargs).create_engine_config()


def test_vllm_resolves_trained_draft_as_eagle3(trained_draft, tiny_llama):
    """vLLM reads the trained draft as Eagle3LlamaForCausalLM with our aux layer ids and draft vocab."""
    from vllm.model_executor.models.registry import ModelRegistry

    # vLLM 0.16.0 reads speculative_tokens from the draft's config only when the draft is served as the model
    # (test below); with --speculative-config the count must be given (without it: a TypeError in its config)
    cfg = _engine_config(model=str(tiny_llama),
                         speculative_config={"model": str(trained_draft), "method": "eagle3", "num_speculative_tokens": 3})
    spec = cfg.speculative_config
    saved = json.loads((trained_draft / "config.json").read_text())
    assert spec.method == "eagle3" and spec.num_speculative_tokens == 3
    draft = spec.draft_model_config
    assert draft.architectures == ["Eagle3LlamaForCausalLM"]
    cls, arch = ModelRegistry.resolve_model_cls(draft.architectures, draft)
    assert arch == "Eagle3LlamaForCausalLM" and cls.__name__ == "Eagle3LlamaForCausalLM"
    hf = draft.hf_config
    assert hf.eagle_aux_hidden_state_layer_ids == [3, 5, 6]  # captured outputs of layers 2, 4, 5 of 8, + 1
    assert hf.draft_vocab_size == saved["draft_vocab_size"]
    assert hf.norm_before_residual is False and hf.hidden_size == 256


def test_vllm_serve_of_the_draft_dir_picks_the_real_target(trained_draft, tiny_llama):
    """`vllm serve DRAFT` takes the target from the draft's verifier entry: the real model, not a training view."""
    cfg = _engine_config(model=str(trained_draft))
    assert cfg.model_config.model == str(tiny_llama.resolve())
    assert cfg.model_config.architectures == ["LlamaForCausalLM"]
    assert cfg.speculative_config.method == "eagle3"
    assert cfg.speculative_config.num_speculative_tokens == 3  # the draft config's speculative_tokens (= --ttt-steps)
    assert cfg.speculative_config.draft_model_config.model == str(trained_draft)
