"""The hf backend's fused MoE experts: which modules are candidates (transformers' experts in vLLM's layout),
that only a kernel proven equal on the probe is taken, that the states stay what they were, that ``close()``
gives every module its forward back, and that ``--fused-experts on`` without the kernel fails in one line.

vLLM's kernel itself runs on a GPU only (tests/vllm/test_fused_experts.py, marked gpu); here a kernel written
in torch from vLLM's definition of ``fused_experts`` (and one with gate and up swapped) stands in for it."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pipeline.backends import fused_experts
from pipeline.backends.base import BackendOptions
from pipeline.backends.hf import FUSE_EXPERTS_MIN_TOKENS, HFBackend, should_fuse_experts
from pipeline.errors import StageError
from pipeline.model.modeldir import read_model_dir
from tests.conftest import run_extract, run_pipeline
from tests.pipeline.test_extract import FP32_ATOL, FP32_RTOL, SEQS


def reference_kernel(hidden, w1, w2, weights, ids, swapped: bool = False):
    """vLLM's ``fused_experts`` in torch: for each of a token's k experts, SiLU(gate) * up of w1 [E, 2I, H]
    (gate rows first), then w2 [E, H, I], weighted by the routing weight and summed over the k."""
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for j in range(ids.shape[1]):
        e = ids[:, j].long()
        h = torch.einsum("th,tih->ti", hidden, w1[e])
        gate, up = h.chunk(2, dim=-1)
        if swapped:
            gate, up = up, gate
        o = torch.einsum("ti,thi->th", nn.functional.silu(gate) * up, w2[e])
        out += weights[:, j : j + 1].float() * o.float()
    return out.to(hidden.dtype)


def swapped_kernel(*args):
    return reference_kernel(*args, swapped=True)


def backend(model_dir, **kw) -> HFBackend:
    model = read_model_dir(model_dir)
    return HFBackend(BackendOptions(model=model, layer_ids=(0, 1, model.num_layers - 1), **kw))


def experts_names(b: HFBackend) -> list[str]:
    return [name for name, _ in fused_experts.candidates(b.decoder)]


def test_transformers_experts_are_candidates_and_a_dense_model_has_none(tiny_deepseek, tiny_llama):
    """Every routed-experts module of a DeepSeek-V3 (the layers after its dense ones) is a candidate; a Llama
    has none."""
    b = backend(tiny_deepseek, fused_experts=False)
    try:
        cfg = b.decoder.config
        want = [f"layers.{i}.mlp.experts" for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers)]
        assert experts_names(b) == want and want
        assert b.fused_experts == []
    finally:
        b.close()
    dense = backend(tiny_llama, fused_experts=False)
    try:
        assert experts_names(dense) == []
    finally:
        dense.close()


@pytest.mark.parametrize(
    "change",
    ["bias", "transposed", "gelu", "no_gate", "interleaved", "odd_shape"],
)
def test_a_layout_vllm_does_not_read_is_no_candidate(tiny_deepseek, change):
    """Biases, transposed or interleaved weights, another activation, no gate or a down_proj of another shape
    are not what vLLM's w1 / w2 are: such a module is left alone."""
    b = backend(tiny_deepseek, fused_experts=False)
    try:
        name, module = fused_experts.candidates(b.decoder)[0]
        if change == "bias":
            module.has_bias = True
        elif change == "transposed":
            module.is_transposed = True
        elif change == "gelu":
            module.act_fn = nn.GELU()
        elif change == "no_gate":
            module.has_gate = False
        elif change == "interleaved":
            module.is_concatenated = False
        else:
            module.down_proj = nn.Parameter(module.down_proj.data[:, :, :-1].clone())
        assert name not in experts_names(b)
    finally:
        b.close()


def test_only_a_kernel_that_agrees_on_the_probe_is_taken(tiny_deepseek, monkeypatch):
    """A kernel computing what transformers' experts compute is fused into every candidate; one with gate and
    up swapped disagrees on the probe and nothing is fused."""
    b = backend(tiny_deepseek, fused_experts=False)
    try:
        names = experts_names(b)
        monkeypatch.setattr(fused_experts, "kernel", lambda: swapped_kernel)
        assert fused_experts.fuse(b.decoder)[:2] == ([], None)
        monkeypatch.setattr(fused_experts, "kernel", lambda: reference_kernel)
        fused, worst, tiles = fused_experts.fuse(b.decoder, tokens=65536)
        # fp32 experts keep vLLM's own tiles: one shape of experts, reported as not timed, and why
        assert [r.get("skipped") for r in tiles.values()] == ["float32 experts, not bf16 or fp16"]
        assert fused == names
        assert worst is not None and worst <= fused_experts.TOLERANCE[torch.float32]
        fused_experts.restore(b.decoder, fused)
        assert all("forward" not in m.__dict__ for _, m in fused_experts.candidates(b.decoder))
    finally:
        b.close()


def test_tiles_are_timed_only_for_large_half_precision_batches_on_a_gpu(tiny_deepseek):
    """Each reason to keep vLLM's own tiles is said for itself: small batches, full-precision experts, the
    CPU (checked in that order, so that each shows here)."""
    b = backend(tiny_deepseek, fused_experts=False)
    try:
        _, module = fused_experts.candidates(b.decoder)[0]
        skipped = [fused_experts.choose_tiles(module, reference_kernel, 100)[1]["skipped"]]
        skipped.append(fused_experts.choose_tiles(module, reference_kernel, 65536)[1]["skipped"])
        module.to(torch.bfloat16)
        skipped.append(fused_experts.choose_tiles(module, reference_kernel, 65536)[1]["skipped"])
        assert skipped == [
            "batches of 100 tokens, under 4096",
            "float32 experts, not bf16 or fp16",
            "not on a GPU",
        ]
    finally:
        b.close()


def test_fused_experts_leave_the_states_as_they_were(tiny_deepseek, monkeypatch):
    """The backend with fused experts captures the states it captures without them (fp32 on the CPU), records
    the modules it fused, and ``close()`` gives each its own forward back."""
    plain = backend(tiny_deepseek, fused_experts=False)
    try:
        want = plain.capture(SEQS)
    finally:
        plain.close()
    monkeypatch.setattr(fused_experts, "kernel", lambda: reference_kernel)
    fused = backend(tiny_deepseek, fused_experts=True)
    try:
        assert fused.fused_experts == experts_names(fused) and fused.fused_experts
        assert "fused_experts_seconds" in fused.startup
        assert list(fused.fused_experts_tiles) and all(
            "skipped" in r for r in fused.fused_experts_tiles.values()
        )
        modules = [m for _, m in fused_experts.candidates(fused.decoder)]
        assert all("forward" in m.__dict__ for m in modules)
        got = fused.capture(SEQS)
    finally:
        fused.close()
    assert all("forward" not in m.__dict__ for m in modules)
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b, atol=FP32_ATOL, rtol=FP32_RTOL)


def test_fused_experts_on_without_the_kernel_fails_in_one_line(tiny_deepseek, tiny_llama, monkeypatch):
    """``--fused-experts on`` where no module can take vLLM's kernel (here: none importable; a dense model,
    even with a kernel) stops the backend with one line naming the option and what to do."""
    monkeypatch.setattr(fused_experts, "kernel", lambda: None)
    with pytest.raises(StageError) as err:
        backend(tiny_deepseek, fused_experts=True)
    assert "--fused-experts on" in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setattr(fused_experts, "kernel", lambda: reference_kernel)
    with pytest.raises(StageError, match="--fused-experts on.*a dense model"):
        backend(tiny_llama, fused_experts=True)


def test_fused_experts_default_to_gpu_runs_only():
    """auto fuses on a GPU only (Triton's kernel), for a run long enough to repay the kernel's start (or of
    unknown length); an explicit choice is kept."""
    assert should_fuse_experts(None, on_gpu=True) is True  # a run of unknown length
    assert should_fuse_experts(None, on_gpu=True, planned_tokens=FUSE_EXPERTS_MIN_TOKENS) is True
    assert should_fuse_experts(None, on_gpu=True, planned_tokens=FUSE_EXPERTS_MIN_TOKENS - 1) is False
    assert should_fuse_experts(True, on_gpu=True, planned_tokens=1) is True
    assert should_fuse_experts(None, on_gpu=False) is False
    assert should_fuse_experts(False, on_gpu=True) is False
    assert should_fuse_experts(True, on_gpu=False) is True


def test_extract_refuses_fused_experts_on_where_it_cannot_run(tmp_path, tiny_deepseek, prepared_llama):
    """Through the CLI: ``--fused-experts on`` on the CPU ends the hf run with one error line and no state
    file written; check-args refuses it with ``--backend vllm``, whose engine runs its own fused MoE."""
    out = tmp_path / "states"
    proc = run_extract(
        prepared_llama, tiny_deepseek, out, "--backend", "hf", "--fused-experts", "on", "--no-progress"
    )
    # one error line (in the vLLM CPU environment, vLLM's import adds a note: Triton has no CPU backend)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1 and "--fused-experts on" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(out.glob("data_*.pt"))
    proc = run_pipeline(
        "check-args", "extract", "--prepared", "p", "--model", "m", "--out", "o", "--backend", "vllm",
        "--fused-experts", "on",
    )  # fmt: skip
    assert proc.returncode == 2 and "--fused-experts on is the hf backend's" in proc.stdout, proc.stdout


def test_importing_the_kernel_leaves_torch_s_cudnn_attention_as_it_was(monkeypatch):
    """vLLM's CUDA platform module turns torch's cuDNN attention off when it is imported; ``kernel()`` puts
    torch's choice back. A stand-in vLLM package does the same as its import (here, on the name's lookup)."""
    import sys
    import types

    def flips_cudnn_off(name):
        if name != "fused_experts":
            raise AttributeError(name)
        torch.backends.cuda.enable_cudnn_sdp(False)
        return reference_kernel

    parts = "vllm.model_executor.layers.fused_moe".split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    sys.modules["vllm.model_executor.layers.fused_moe"].__getattr__ = flips_cudnn_off
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert fused_experts.kernel() is reference_kernel
        assert torch.backends.cuda.cudnn_sdp_enabled() is True
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


class Tiled:
    """A stand-in for vLLM's kernel under ``override_config``: its milliseconds and its output per tile set
    (the index in ``TILES``; None: the default), and the sets it cannot run (raises, as Triton does when a
    set wants more shared memory than the GPU has)."""

    def __init__(self, ms: dict, wrong=(), fails=()):
        self.ms, self.wrong, self.fails, self.current = ms, set(wrong), set(fails), None

    def override(self, tiles):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            before, self.current = self.current, None if tiles is None else fused_experts.TILES.index(tiles)
            try:
                yield
            finally:
                self.current = before

        return ctx()

    def forward(self, x):
        if self.current in self.fails:
            raise RuntimeError("out of resources: shared memory")
        return x * (2.0 if self.current in self.wrong else 1.0)

    def timer(self, run):
        run()
        return self.ms[self.current]


@pytest.mark.parametrize(
    "ms, wrong, fails, chosen",
    [
        ({None: 10.0, 0: 7.0, 1: 8.0, 2: 12.0}, (), (), 0),  # the fastest set
        ({None: 10.0, 0: 9.9, 1: 9.8, 2: 11.0}, (), (), None),  # within MIN_GAIN: the default stays
        ({None: 10.0, 0: 7.0, 1: 8.0, 2: 12.0}, (), (0,), 1),  # a set the GPU cannot run is skipped
        ({None: 10.0, 0: 7.0, 1: 8.0, 2: 12.0}, (0,), (), None),  # the fastest disagrees: the default
        (
            {None: 10.0, 0: 7.0, 1: 8.0, 2: 12.0},
            (),
            (None,),
            None,
        ),  # no default timed: nothing to beat
    ],
)
def test_the_kernel_s_tiles_are_the_fastest_that_compute_what_the_default_computes(ms, wrong, fails, chosen):
    """Tile sets replace vLLM's default only when measurably faster (``MIN_GAIN``) and equal in output; the
    report keeps every timing (None for a set that failed)."""
    kernel = Tiled(ms, wrong, fails)
    x = torch.randn(64, 8)
    got, report = fused_experts.time_tiles(kernel.forward, (x,), kernel.override, 2e-2, timer=kernel.timer)
    assert got == chosen == report["chosen"]
    assert report["tiles_ms"] == [None if i in fails else ms[i] for i in range(len(fused_experts.TILES))]
    assert ("error" in report) == (chosen is not None or bool(wrong))
    assert kernel.current is None  # every override undone


def test_no_tile_sets_keep_vllms_own_choice():
    """``expert_tiles=()`` (hf_levers' ``-fxv`` rows): only vLLM's default is timed, and it stays."""
    kernel = Tiled({None: 10.0, 0: 1.0, 1: 1.0, 2: 1.0}, (), ())
    got, report = fused_experts.time_tiles(
        kernel.forward, (torch.randn(4, 8),), kernel.override, 2e-2, timer=kernel.timer, tiles=()
    )
    assert got is None and report == {"default_ms": 10.0, "tiles_ms": [], "chosen": None}


def test_a_tile_choice_is_kept_on_the_host_and_taken_again(tmp_path):
    """The first run times and keeps its choice; a rerun (a resume) takes it without timing, so its states
    are computed with the same tiles; another key (GPU, versions, shape, batch, sets) is timed and kept
    beside it; a file that cannot be read is timed over, one that cannot be written leaves the choice
    unkept and says why."""
    path, runs = tmp_path / "cache" / "eagle-ops" / "tiles.json", []

    def timed(chosen):
        def compute():
            runs.append(chosen)
            return {"default_ms": 10.0, "tiles_ms": [7.0], "chosen": chosen}

        return compute

    first = fused_experts.remembered(path, "H100 | a", timed(0))
    assert first == {"default_ms": 10.0, "tiles_ms": [7.0], "chosen": 0} and runs == [0]
    again = fused_experts.remembered(path, "H100 | a", timed(None))  # the timing would now pick the default
    assert again == first | {"kept": True} and runs == [0]
    fused_experts.remembered(path, "H100 | b", timed(None))
    assert runs == [0, None] and set(json.loads(path.read_text())) == {"H100 | a", "H100 | b"}
    assert not list(path.parent.glob(".*.partial"))  # written under a temporary name, then renamed
    path.write_text("{not json")
    assert fused_experts.remembered(path, "H100 | a", timed(0))["chosen"] == 0 and runs == [0, None, 0]
    assert json.loads(path.read_text()) == {"H100 | a": first}
    blocked = tmp_path / "file"
    blocked.write_text("")
    unkept = fused_experts.remembered(blocked / "tiles.json", "H100 | a", timed(0))
    assert unkept["chosen"] == 0 and "not_kept" in unkept
    assert fused_experts.remembered(None, "k", timed(0))["not_kept"] == "vLLM names no cache root"


def test_the_workers_of_a_host_take_the_first_ones_tile_choice(tmp_path):
    """Data-parallel workers start together: one times the tiles while the others wait on the lock, then take
    its choice, so every worker computes with the same tiles (threads here; each opens the lock file itself,
    as a process does)."""
    import threading
    import time

    path, runs, results = tmp_path / "tiles.json", [], []

    def compute():
        runs.append(threading.current_thread().name)
        time.sleep(0.3)  # the timing: the others arrive meanwhile
        return {"chosen": len(runs)}

    workers = [
        threading.Thread(
            target=lambda: results.append(fused_experts.remembered(path, "H100 | a", compute)), name=f"w{n}"
        )
        for n in range(3)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(runs) == 1 and [r["chosen"] for r in results] == [1, 1, 1]
    assert sum(r.get("kept", False) for r in results) == 2
