"""The vllm backend's guards against the seeds' silent failure classes, on real connector files read by vLLM's
own reader: lost layers, states of another sample (reordered results), states short by whole blocks (a
prefix-cache hit), and a failed write. Each guard is the only thing between such a file and a wrong
data_{i}.pt."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.errors import StageError

pytestmark = pytest.mark.vllm

HIDDEN = 8
LAYERS = (2, 4, 5, 7)


def bare_backend():
    """A VllmBackend with no engine: enough state for reading and checking files."""
    from pipeline.backends.vllm import VllmBackend

    backend = object.__new__(VllmBackend)
    backend.layer_ids = list(LAYERS)
    backend.options = SimpleNamespace(model=SimpleNamespace(hidden_size=HIDDEN), seq_length=64)
    return backend


def connector_file(tmp_path: Path, tokens: list[int], layers: int = len(LAYERS), name: str = "0-abc") -> Path:
    """A file as ExampleHiddenStatesConnector writes it (hidden_states [T, layers, H], token_ids [T]) and its
    lock."""
    from safetensors.torch import save_file

    path = tmp_path / f"{name}.safetensors"
    states = torch.arange(len(tokens) * layers * HIDDEN, dtype=torch.float32).reshape(
        len(tokens), layers, HIDDEN
    )
    save_file({"hidden_states": states, "token_ids": torch.tensor(tokens)}, str(path))
    Path(str(path) + ".lock").touch()
    return path


def output(tokens: list[int], path: Path | None) -> SimpleNamespace:
    return SimpleNamespace(
        prompt_token_ids=tokens, kv_transfer_params={"hidden_states_path": str(path)} if path else None
    )


def test_a_good_file_gives_one_owned_state_per_layer_and_is_removed(tmp_path):
    """A well-formed file gives 4 contiguous [T, H] tensors (layer j = slice j), then file and lock are
    gone."""
    seq = [5, 6, 7]
    path = connector_file(tmp_path, seq)
    states = bare_backend()._read(0, seq, output(seq, path))
    assert [tuple(h.shape) for h in states] == [(3, HIDDEN)] * 4
    assert all(h.is_contiguous() for h in states)
    assert torch.equal(states[2][1], torch.arange(HIDDEN, dtype=torch.float32) + (1 * 4 + 2) * HIDDEN)
    assert not path.exists() and not Path(str(path) + ".lock").exists()


def test_lost_layers_are_refused(tmp_path):
    """A file with 3 of the 4 layers (the field bug "1 of 4 layers kept", in kind) is a StageError naming the
    shape."""
    seq = [5, 6, 7]
    with pytest.raises(StageError, match=r"shape \(3, 3, 8\), expected \(3, 4, 8\)"):
        bare_backend()._read(0, seq, output(seq, connector_file(tmp_path, seq, layers=3)))


def test_states_short_by_cached_blocks_are_refused(tmp_path):
    """States for fewer tokens than the sample (prefix caching hands back only the uncached tail) are
    refused."""
    seq = list(range(10, 50))
    path = connector_file(tmp_path, seq[16:])
    with pytest.raises(
        StageError,
        match="other tokens .24 ids, expected 40.: results out of input order or a prefix-cache hit",
    ):
        bare_backend()._read(0, seq, output(seq, path))


def test_another_samples_file_is_refused(tmp_path):
    """A result whose file holds another sample's tokens (results reordered) is refused."""
    seq, other = [5, 6, 7], [5, 6, 8]
    with pytest.raises(StageError, match="for other tokens"):
        bare_backend()._read(1, seq, output(seq, connector_file(tmp_path, other)))


def test_a_result_for_another_prompt_is_refused(tmp_path):
    """A result whose prompt is another input's is refused before its file is trusted."""
    seq = [5, 6, 7]
    with pytest.raises(StageError, match="belongs to another input"):
        bare_backend()._read(0, seq, output([9, 9, 9], connector_file(tmp_path, seq)))


def test_a_missing_or_unwritten_file_is_named(tmp_path):
    """No path in kv_transfer_params (connector off), or a path whose write failed, is a one-line
    StageError."""
    seq = [5, 6, 7]
    with pytest.raises(StageError, match="names no hidden-states file"):
        bare_backend()._read(0, seq, output(seq, None))
    missing = tmp_path / "lost.safetensors"
    Path(str(missing) + ".lock").touch()
    with pytest.raises(StageError, match="cannot read vLLM's hidden states of sample 0"):
        bare_backend()._read(0, seq, output(seq, missing))


def test_engine_arguments_force_extraction_settings_and_map_layer_ids(tmp_path):
    """The engine gets vLLM ids = ours + 1, prefix caching and chunked prefill off, the connector writing into
    the scratch folder, and no CPU-only setting (eager mode only when asked)."""
    from pipeline.backends.base import BackendOptions
    from pipeline.backends.vllm import engine_arguments

    options = BackendOptions(
        model=SimpleNamespace(path=Path("/m"), is_wrapper=False),
        layer_ids=(2, 16, 29, 31),
        seq_length=4096,
        max_batch_tokens=1024,
    )
    args = engine_arguments(options, 8, tmp_path)
    assert args["speculative_config"] == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [3, 17, 30, 32]}},
    }
    assert args["kv_transfer_config"]["kv_connector"] == "EagleStatesConnector"
    assert args["kv_transfer_config"]["kv_connector_module_path"] == "pipeline.backends.vllm_connector"
    assert args["kv_transfer_config"]["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path)}
    assert (args["enable_prefix_caching"], args["enable_chunked_prefill"], args["enforce_eager"]) == (
        False,
        False,
        False,
    )
    assert (args["tensor_parallel_size"], args["max_num_batched_tokens"], args["max_model_len"]) == (
        8,
        4096,
        4096,
    )
    assert "gpu_memory_utilization" not in args  # vLLM's own default, unless a trainer shares the GPU
    shared = BackendOptions(model=options.model, layer_ids=options.layer_ids, memory_share=0.35)
    assert engine_arguments(shared, 1, tmp_path)["gpu_memory_utilization"] == 0.35
    assert "enable_expert_parallel" not in args and "enable_ep_weight_filter" not in args
    spread = BackendOptions(model=options.model, layer_ids=options.layer_ids, expert_parallel=True)
    ep = engine_arguments(spread, 8, tmp_path)  # --expert-parallel: whole experts per rank, only theirs read
    assert (ep["enable_expert_parallel"], ep["enable_ep_weight_filter"], ep["tensor_parallel_size"]) == (
        True,
        True,
        8,
    )


def our_connector_file(tmp_path: Path, tokens: list[int], layers: int = len(LAYERS)) -> Path:
    """A file as our EagleStatesConnector writes it (per-layer states and their facts) and its lock."""
    from safetensors.torch import save_file

    from pipeline.backends.vllm_connector import step_tensors

    path = tmp_path / "1-ours.safetensors"
    cache = torch.randn(-(-len(tokens) // 4), layers, 4, HIDDEN)  # [blocks, layers, block_size, H]
    (tensors,) = step_tensors(cache, [(list(range(cache.shape[0])), torch.tensor(tokens))], torch.clone)
    save_file(tensors, str(path))
    Path(str(path) + ".lock").touch()
    return path


def test_our_connectors_file_gives_its_states_and_facts_unchanged(tmp_path):
    """Our connector's layout: each layer's [T, H] state as written, and the scales it computed equal
    layer_profile.token_scales of those states (what the writer's record would otherwise compute)."""
    from pipeline.model.layer_profile import token_scales

    seq = [5, 6, 7, 8]
    path = our_connector_file(tmp_path, seq)
    from safetensors.torch import load_file

    written = load_file(str(path))
    scales: list = []
    states = bare_backend()._read(0, seq, output(seq, path), None, scales)
    assert [tuple(h.shape) for h in states] == [(4, HIDDEN)] * 4 and all(h.is_contiguous() for h in states)
    for j, h in enumerate(states):
        assert torch.equal(h, written[f"hidden_states.{j}"])
        rms, bad = token_scales(h)
        assert torch.equal(scales[j][0], rms) and torch.equal(scales[j][1], bad)
    assert not path.exists()


def test_our_connectors_file_with_a_lost_layer_is_refused(tmp_path):
    """Three of four per-layer states (the field bug in kind, our layout): a StageError naming the shape."""
    seq = [5, 6, 7]
    with pytest.raises(StageError, match=r"shape \(3, 3, 8\), expected \(3, 4, 8\)"):
        bare_backend()._read(0, seq, output(seq, our_connector_file(tmp_path, seq, layers=3)))


def test_handoff_gives_each_entry_once_and_forgets_dropped_ones():
    """The in-memory hand-over: take returns what put gave (after its copy's event), once; a drop before
    or after the put leaves nothing behind; a connector of another process never claims it."""
    import os

    from pipeline.backends.vllm_connector import Handoff

    class Event:
        synced = 0

        def synchronize(self):
            Event.synced += 1

    h = Handoff()
    assert not h.claim()  # not enabled: a connector writes files
    h.enable()
    assert h.claim() and h.connected
    h.put("a", Event(), {"x": 1})
    assert h.take("a", alive=lambda: None) == {"x": 1} and Event.synced == 1
    h.drop("b")  # nobody will read b: its later put is discarded
    h.put("b", Event(), {"x": 2})
    h.put("c", Event(), {"x": 3})
    h.drop("c")  # dropped after it arrived
    assert len(h) == 0
    pid = os.fork()
    if pid == 0:  # a forked engine process inherits the module's state, not the right to hand over
        os._exit(0 if not h.claim() else 1)
    assert os.waitpid(pid, 0)[1] == 0


def test_handoff_take_gives_up_when_the_engine_stopped():
    """A reader waiting for a request whose states never come raises the engine's error, not a hang."""
    from pipeline.backends.vllm_connector import Handoff

    h = Handoff()
    h.enable()
    calls = []

    def alive():
        calls.append(1)
        if len(calls) > 2:
            raise StageError("the vLLM engine stopped: RuntimeError: boom")

    with pytest.raises(StageError, match="engine stopped"):
        h.take("never", alive=alive, poll=0.01)


def test_a_steps_saves_are_each_requests_states_per_layer_with_their_facts():
    """step_tensors: for each request saved in a step, per layer the [T, H] rows of its blocks (vLLM's own
    extract_from_kv_cache is the reference) in a tensor of its own, and token_scales of each."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        extract_from_kv_cache,
    )

    from pipeline.backends.vllm_connector import slot_mapping, step_tensors
    from pipeline.model.layer_profile import token_scales

    cache = torch.randn(6, 3, 4, HIDDEN)  # [blocks, layers, block_size, H]
    cache[1, 2, 3, 0] = float("nan")  # block 1, layer 2, offset 3: the first request's token 3
    saves = [([1, 4], torch.arange(7)), ([0], torch.arange(3) + 50), ([5, 2, 3], torch.arange(9) + 90)]
    out = step_tensors(cache, saves, torch.clone)
    assert len(out) == len(saves)
    for (blocks, ids), tensors in zip(saves, out, strict=True):
        assert torch.equal(tensors["token_ids"], ids)
        block = extract_from_kv_cache(cache, slot_mapping(blocks, 4), len(ids))
        for j in range(3):
            h = tensors[f"hidden_states.{j}"]
            assert h.is_contiguous() and h.untyped_storage().nbytes() == h.nbytes  # its own storage
            torch.testing.assert_close(h, block[:, j], rtol=0, atol=0, equal_nan=True)
            rms, bad = token_scales(block[:, j].contiguous())
            assert torch.allclose(tensors[f"token_rms.{j}"], rms, equal_nan=True)
            assert torch.equal(tensors[f"nonfinite.{j}"], bad)
    assert out[0]["nonfinite.2"].tolist() == [0, 0, 0, 1, 0, 0, 0]
    assert sum(int(t[f"nonfinite.{j}"].sum()) for t in out for j in range(3)) == 1
    assert slot_mapping([3, 1], 4).tolist() == [12, 13, 14, 15, 4, 5, 6, 7]


@pytest.mark.parametrize(
    "raw, dtype, on_gpu, env, refused",
    [
        ({"kv_lora_rank": 512}, "float32", True, {}, True),
        ({"text_config": {"kv_lora_rank": 512}}, "float32", True, {}, True),  # the Kimi-K2.5 wrapper
        ({"kv_lora_rank": 512}, "bfloat16", True, {}, False),
        ({"kv_lora_rank": 512}, "float32", False, {}, False),  # the CPU build runs it without MLA
        ({"kv_lora_rank": 512}, "float32", True, {"VLLM_MLA_DISABLE": "1"}, False),
        ({"num_attention_heads": 8}, "float32", True, {}, False),  # no MLA
    ],
)
def test_fp32_mla_on_a_gpu_is_refused_in_one_line(raw, dtype, on_gpu, env, refused):
    """vLLM 0.32's CUDA MLA backends take no fp32 (the H200 engine died at start): refused before loading."""
    from pipeline.backends.vllm import check_attention_dtype

    options = SimpleNamespace(model=SimpleNamespace(raw=raw, path="/m"), dtype=dtype)
    if refused:
        with pytest.raises(StageError, match=r"^/m: an MLA model .* use --dtype bfloat16"):
            check_attention_dtype(options, on_gpu, env)
    else:
        check_attention_dtype(options, on_gpu, env)


@pytest.mark.parametrize(
    "raw, save_dtype, on_gpu, want",
    [
        ({"kv_lora_rank": 512}, "float32", True, "bfloat16"),  # vLLM's CUDA MLA takes no fp32
        ({"text_config": {"kv_lora_rank": 512}}, "float32", True, "bfloat16"),
        ({"kv_lora_rank": 512}, "float32", False, "float32"),  # the CPU build serves it without MLA
        ({"num_attention_heads": 8}, "float32", True, "float32"),
        ({"kv_lora_rank": 512}, "bfloat16", True, "auto"),
    ],
)
def test_online_eval_serves_an_mla_target_in_bf16_on_a_gpu(raw, save_dtype, on_gpu, want, monkeypatch):
    """The train stage's online acceptance would start vLLM in fp32 for an fp32-saved draft: on a GPU an MLA
    target has no such attention, so it is served in bf16 there (the H200's served-DeepSeek test died)."""
    from pipeline.backends import base
    from pipeline.train import stage

    monkeypatch.setattr(base, "visible_device_count", lambda: 1 if on_gpu else 0)
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    monkeypatch.setattr("pipeline.model.modeldir.read_model_dir", lambda path: SimpleNamespace(raw=raw))
    assert stage.online_dtype(SimpleNamespace(save_dtype=save_dtype), Path("/m")) == want
