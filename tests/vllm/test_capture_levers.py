"""The vLLM capture path's levers (issue #52; pipeline/backends/vllm_connector.py's docstring): each one
switched on against today's path on the same engine gives bit-identical states, facts and data files.

The engine is the session's TP-1 fp32 eager one with steps of at most 128 tokens
(``llama_backend_small_steps``), so a 45-sequence batch runs in many steps and a pool of two buffers is
used up and refilled. The levers are read at every step, so one engine runs every variant: the batch goes
through it once per variant, each time into an idle engine, so its steps are the same steps. Control: the
same batch twice with every lever off is bit-identical too (else the comparisons would prove nothing).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from pipeline.ondisk import formats

LEVER_VARS = ("EAGLE_VLLM_BULK_COPY", "EAGLE_VLLM_PINNED_POOL", "EAGLE_VLLM_CONNECTOR_THREAD")
VARIANTS = {
    "bulk": {"EAGLE_VLLM_BULK_COPY": "1"},
    "bulk+pool": {"EAGLE_VLLM_BULK_COPY": "1", "EAGLE_VLLM_PINNED_POOL": "2"},
    "bulk+pool+thread": {
        "EAGLE_VLLM_BULK_COPY": "1",
        "EAGLE_VLLM_PINNED_POOL": "2",
        "EAGLE_VLLM_CONNECTOR_THREAD": "1",
    },
    "thread": {"EAGLE_VLLM_CONNECTOR_THREAD": "1"},
}


def _batch(n: int = 45, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(6, 1000) for _ in range(rng.choice([1, 3, 17, 40, 64, 100, 127]))] for _ in range(n)
    ]


def _capture(backend, batch, monkeypatch, env: dict[str, str]):
    """Each sample's states and facts with the levers of ``env`` (every other lever off)."""
    for name in LEVER_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    captured = backend.capture_async(batch)
    states = captured.wait_all()
    return states, captured.scales


def _file_digests(tmp_path, name: str, batch, states) -> list[str]:
    """sha256 of each sample's data file as the extract writer writes it."""
    out = []
    for i, (seq, hs) in enumerate(zip(batch, states, strict=True)):
        ids = torch.tensor(seq, dtype=torch.long)
        target = tmp_path / f"{name}-{i}.pt"
        out.append(formats.write_sample(target, ids, hs, torch.ones_like(ids)).sha256)
    return out


def _assert_identical(got, want, what: str) -> None:
    (gs, gf), (ws, wf) = got, want
    assert len(gs) == len(ws)
    for i, (a, b) in enumerate(zip(gs, ws, strict=True)):
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert x.dtype == y.dtype and x.shape == y.shape, (what, i, k)
            assert torch.equal(x, y), (what, i, k, float((x - y).abs().max()))
            assert x.untyped_storage().nbytes() == x.nbytes, (what, i, k)  # owns exactly its bytes
        for k, ((r1, n1), (r2, n2)) in enumerate(zip(gf[i], wf[i], strict=True)):
            assert torch.equal(r1, r2) and torch.equal(n1, n2), (what, i, k)


@pytest.mark.vllm
def test_each_lever_keeps_states_facts_and_files_bit_identical(
    llama_backend_small_steps, tmp_path, monkeypatch
):
    from pipeline.backends.vllm_connector import STATS

    backend = llama_backend_small_steps
    batch = _batch()
    assert sum(map(len, batch)) > 10 * backend.settings["max_num_batched_tokens"]
    today = _capture(backend, batch, monkeypatch, {})
    again = _capture(backend, batch, monkeypatch, {})
    _assert_identical(again, today, "control: today's path twice")
    del again
    want_files = _file_digests(tmp_path, "today", batch, today[0])
    for name, env in VARIANTS.items():
        gc.collect()
        got = _capture(backend, batch, monkeypatch, env)
        figures = STATS.figures()
        assert figures["levers"] == (
            "thread" if name == "thread" else name.replace("pool", "pool 2").replace("+", ", ")
        )
        _assert_identical(got, today, name)
        assert _file_digests(tmp_path, name, batch, got[0]) == want_files, name
        if "pool" in name:  # two kept buffers at most; the steps the writers still held went elsewhere
            assert 1 <= figures["pool_allocated"] <= 2 and figures["pool_misses"] > 0, figures
        del got
    assert STATS.figures()["save_steps"] > 0 and STATS.figures()["bytes_copied"] > 0


@pytest.mark.vllm
def test_the_pool_hands_a_buffer_out_again_only_once_its_tensors_are_gone(
    llama_backend_small_steps, monkeypatch
):
    """With every state of a capture dropped, the next capture reuses the kept buffers (no new allocation);
    while they are held, a step gets a buffer of its own (a miss), never a kept one in use."""
    from pipeline.backends.vllm_connector import STATS

    backend = llama_backend_small_steps
    env = {"EAGLE_VLLM_BULK_COPY": "1", "EAGLE_VLLM_PINNED_POOL": "1"}
    batch = _batch(n=12, seed=5)
    first = _capture(backend, batch, monkeypatch, env)
    allocated = STATS.figures()["pool_allocated"]
    held = _capture(backend, batch, monkeypatch, env)  # `first` still holds the kept buffer
    assert STATS.figures()["pool_allocated"] == allocated == 1
    assert STATS.figures()["pool_misses"] > 0
    _assert_identical(held, first, "pool, buffer held")
    del first, held
    gc.collect()
    misses = STATS.pool_misses
    _capture(backend, [batch[0]], monkeypatch, env)  # one step: the kept buffer is free again
    assert STATS.pool_misses == misses and STATS.figures()["pool_allocated"] == 1


@pytest.mark.vllm  # the connector module imports vLLM's KV-connector API
def test_levers_and_step_tokens_from_the_environment():
    from pipeline.backends.vllm import step_tokens
    from pipeline.backends.vllm_connector import Levers
    from pipeline.errors import StageError

    assert Levers.from_env({}) == Levers()
    assert Levers.from_env({"EAGLE_VLLM_BULK_COPY": "1", "EAGLE_VLLM_PINNED_POOL": "3"}) == Levers(True, 3)
    assert Levers.from_env({"EAGLE_VLLM_CONNECTOR_THREAD": "off", "EAGLE_VLLM_PINNED_POOL": "x"}) == Levers()
    assert step_tokens({}) is None and step_tokens({"EAGLE_VLLM_STEP_TOKENS": "65536"}) == 65536
    with pytest.raises(StageError, match="EAGLE_VLLM_STEP_TOKENS"):
        step_tokens({"EAGLE_VLLM_STEP_TOKENS": "-4"})


def test_the_engine_step_follows_step_tokens_not_below_seq_length(tiny_llama, tmp_path):
    from pipeline.backends.base import BackendOptions
    from pipeline.backends.vllm import engine_arguments
    from pipeline.model.modeldir import read_model_dir

    options = BackendOptions(model=read_model_dir(tiny_llama), layer_ids=(2, 4, 5, 7), seq_length=2048)
    assert engine_arguments(options, 1, tmp_path)["max_num_batched_tokens"] == 32768
    assert engine_arguments(options, 1, tmp_path, step_tokens=65536)["max_num_batched_tokens"] == 65536
    assert engine_arguments(options, 1, tmp_path, step_tokens=512)["max_num_batched_tokens"] == 2048
