"""vLLM patches 0001/0003 on real code: DeepSeek-V3 as an EAGLE-3 target, and llama_4_scaling in the capture.

One vLLM instance of the tiny DeepseekV3 with a `llama_4_scaling` section (beta 0.5 from position 8 on) first
captures through speculators' forward (patch 0003 passes llama_4_scaling), then is switched to vLLM's own
forward returning EAGLE-3 auxiliary states (SupportsEagle3, patch 0001). The aux state of layer k+1 (its
input) must equal speculators' capture of layer k (its output): the layer-id convention of DESIGN.md
section 4, on the code that will serve the draft.
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import copy_model, per_token_rel

pytestmark = pytest.mark.vllm

LAYER_IDS = (2, 4, 5, 7)
SCALING = {"original_max_position_embeddings": 8, "beta": 0.5}
SEQS = [[1, 3, 17, 250, 251, 99, 7, 8, 9, 10, 11, 12, 400, 401, 5, 77, 78, 79, 80, 81], [1, 3, 42, 43, 44]]


@pytest.fixture(scope="module")
def scaled_deepseek(deepseek_for_vllm, tmp_path_factory):
    return copy_model(deepseek_for_vllm, tmp_path_factory.mktemp("dsv3-l4s") / "model", llama_4_scaling=SCALING)


@pytest.fixture(scope="module")
def captures(scaled_deepseek):
    """(speculators captures, vLLM EAGLE-3 aux captures, model class name) from one vLLM instance."""
    import cloudpickle

    from pipeline.backends.base import BackendOptions
    from pipeline.backends.vllm import VllmBackend
    from pipeline.modeldir import read_model_dir
    from tests.vllm import eagle3_probe

    backend = VllmBackend(BackendOptions(model=read_model_dir(scaled_deepseek), layer_ids=LAYER_IDS, dtype="float32",
                                         seq_length=64, tensor_parallel_size=1))
    try:
        speculators_states = backend.capture(SEQS)
        cloudpickle.register_pickle_by_value(eagle3_probe)
        names = backend._generator.executor.collective_rpc(
            eagle3_probe.use_vllm_eagle3_aux, args=(tuple(k + 1 for k in LAYER_IDS[:-1]),))
        results = backend._generator.generate(SEQS)
    finally:
        backend.close()
    return speculators_states, [r["hidden_states"] for r in results], names[0]


def test_deepseek_eagle3_aux_states_equal_the_captured_layer_outputs(captures):
    """vLLM's EAGLE-3 aux state of layer k+1 equals speculators' capture of layer k, for each of the 3 aux layers."""
    ours, aux, name = captures
    assert name == "DeepseekV3ForCausalLM"
    for seq, mine, theirs in zip(SEQS, ours, aux, strict=True):
        assert len(theirs) == 3
        for k in range(3):
            assert theirs[k].shape == (len(seq), 256)
            assert per_token_rel(mine[k], theirs[k]) < 1e-5, (k, per_token_rel(mine[k], theirs[k]))


def test_llama_4_scaling_reaches_the_captured_layers(captures, scaled_deepseek):
    """Captures equal transformers (which ignores llama_4_scaling) before position 8 and differ after it."""
    from pipeline.backends.base import BackendOptions
    from pipeline.backends.hf import HFBackend
    from pipeline.modeldir import read_model_dir

    ours, _, _ = captures
    hf = HFBackend(BackendOptions(model=read_model_dir(scaled_deepseek), layer_ids=LAYER_IDS, device="cpu",
                                  dtype="float32")).capture(SEQS)
    long_seq, mine, ref = SEQS[0], ours[0], hf[0]
    for k in range(4):
        assert per_token_rel(mine[k][:8], ref[k][:8]) < 1e-5
        assert per_token_rel(mine[k][8:], ref[k][8:]) > 1e-3
    assert len(long_seq) > 8
