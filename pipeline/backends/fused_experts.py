"""The hf backend's fused MoE experts: each routed-experts module of a decoder that is proven to compute what
vLLM's fused MoE kernel computes runs through that kernel instead of transformers' experts forward.

Transformers 5.19 runs an MoE's routed experts (``grouped_mm``, its default) as a sort of the token-expert
pairs, a gather of each pair's row, two grouped GEMMs with the SiLU between them, the routing weights, the
unsort and a sum over the top-k: on dsv3-9b a third of the loop's kernel time was that glue around the GEMMs
(docs/benchmarks.md, "The hf backend's MoE loop, by kind of kernel"). vLLM's ``fused_experts`` (Triton) reads
each pair's row inside its first GEMM and applies the routing weight inside its second: the kernel vLLM's own
engine runs for the same layers.

A module is a candidate when it holds its experts as transformers lays them out
(``use_experts_implementation``): a 3-D ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and
``down_proj`` [E, H, I], no biases, not transposed, a gate, and SiLU as its activation; that is vLLM's w1 / w2
layout. It is fused only when its own forward and the kernel agree on a probe batch on the model's device
and dtype; the rest keep their forward. The kernel needs vLLM and a GPU: without either nothing is fused.
``restore`` puts every forward back.

vLLM picks the kernel's tiles from a file tuned for the experts' shape on the GPU at hand, or from a generic
default where it ships none (none for dsv3-9b's E=64, N=1408 on an H100, where that default's GEMM took
38-42% more time than torch's grouped GEMMs). Where it has no file, ``choose_tiles`` times the default against
the few tile sets of ``TILES`` on a batch of the loop's size and keeps the fastest, for batches of at least
``TUNE_FROM`` tokens; the tiles change only the order of the fp32 sums inside each GEMM. The choice is kept
on the host (``remembered``: a JSON file under vLLM's cache root, which compose.yaml persists), keyed by the
GPU, the versions of vLLM, Triton and torch, the experts' shape and dtype, the batch timed and the sets
tried: a rerun or a resumed run takes the same tiles, so its states are computed as the first run's were,
without timing them again, and a host's data-parallel workers take the first one's choice.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from pipeline.backends.fused_norms import restore  # noqa: F401 - the same: each named module's own forward back
from pipeline.ondisk.atomic import write_json

# a probe agrees when the largest difference is within this share of the largest output: a few roundings of
# the dtype (both paths accumulate each GEMM in fp32; they round the intermediate and the sum differently)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
PROBE_TOKENS = 256
# tile sets timed beside vLLM's default where vLLM ships no tuned file (its files for Hopper bf16 MoEs of 64
# experts and N from 640 to 2560 pick the first for large batches); a set the GPU cannot run is skipped. On
# dsv3-9b's experts (H100, 64k tokens) the first ran in 13.7 ms against the default's 15.2, the last in 15.9;
# 256 x 256 tiles took 98.5 ms (dropped)
TILE_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
TILES = tuple(
    dict(zip(TILE_KEYS, values, strict=True))
    for values in (
        (128, 256, 64, 1, 8, 4),
        (128, 256, 64, 16, 8, 4),
        (128, 128, 64, 1, 4, 4),
    )
)
TUNE_FROM = 4096  # batches of fewer tokens keep vLLM's own choice
TUNE_TOKENS = 65536  # the largest batch timed (a larger loop batch is timed at this size)
TUNE_REPEATS = 3
MIN_GAIN = 0.03  # a tile set replaces the default only when it is at least this much faster
TILES_FILE = "eagle-ops/fused-experts-tiles.json"  # under vLLM's cache root: the choices made on this host


def kernel():
    """vLLM's fused experts function, or None where vLLM (or its fused MoE) cannot be imported. Importing it
    leaves torch's attention choice as it was: vLLM's CUDA platform module turns torch's cuDNN attention off
    for the whole process (vllm/platforms/cuda.py), which moved dsv3-9b's attention to a kernel 4x slower."""
    cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except Exception:  # noqa: BLE001 - no vLLM, or a build without the kernel: the experts keep their forward
        return None
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
    return fused_experts


def is_silu(act) -> bool:
    """Whether ``act`` computes SiLU (transformers has its own classes for it, so its values decide)."""
    if not callable(act):
        return False
    x = torch.linspace(-6, 6, 49)
    try:
        y = act(x)
    except Exception:  # noqa: BLE001 - not an elementwise activation
        return False
    return isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y, nn.functional.silu(x))


def candidates(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Experts modules laid out as vLLM's fused kernel reads them (see the module docstring)."""
    found = []
    for name, module in root.named_modules():
        w1, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(w1, nn.Parameter) and isinstance(w2, nn.Parameter)):
            continue
        if w1.dim() != 3 or w2.dim() != 3:
            continue
        experts, two_i, hidden = w1.shape
        if two_i % 2 or w2.shape != (experts, hidden, two_i // 2):
            continue
        if getattr(module, "has_bias", True) or getattr(module, "is_transposed", True):
            continue
        if not (getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)):
            continue
        if not is_silu(getattr(module, "act_fn", None)):
            continue
        found.append((name, module))
    return found


def fused_forward(module: nn.Module, fused_experts, tiles: dict | None = None):
    """The fused kernel as ``module``'s forward: (hidden_states [T, H], top_k_index [T, k], top_k_weights
    [T, k]) -> [T, H], as transformers' experts forward takes and returns them. ``tiles``: the kernel's tile
    set for batches of ``TUNE_FROM`` tokens or more (None: vLLM's own choice for every batch)."""
    w1, w2 = module.gate_up_proj, module.down_proj
    override = tile_override() if tiles is not None else None

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        args = (hidden_states.contiguous(), w1, w2, top_k_weights.float(), top_k_index.to(torch.int32))
        if override is None or hidden_states.shape[0] < TUNE_FROM:
            return fused_experts(*args)
        with override(tiles):
            return fused_experts(*args)

    return forward


def tile_override():
    """vLLM's context that makes the fused kernel run one tile set (the one its own tuning bench uses)."""
    from vllm.model_executor.layers.fused_moe import override_config

    return override_config


def has_tuned_tiles(module: nn.Module) -> bool:
    """Whether vLLM ships (or ``VLLM_TUNED_CONFIG_FOLDER`` holds) tiles tuned for ``module``'s experts on
    this GPU."""
    from vllm.model_executor.layers.fused_moe.fused_moe import get_moe_configs

    experts, two_i, _ = module.gate_up_proj.shape
    return get_moe_configs(experts, two_i // 2, None) is not None


def top_k(module: nn.Module) -> int:
    """The experts each token meets, from the config transformers gives the module (2 where it has none)."""
    k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
    experts = module.gate_up_proj.shape[0]
    return min(k, experts) if isinstance(k, int) and k > 0 else min(2, experts)


def routed_batch(module: nn.Module, tokens: int, seed: int = 0):
    """``tokens`` random rows on ``module``'s device and dtype, each routed to k distinct random experts with
    random positive weights: (hidden_states, top_k_index, top_k_weights)."""
    w1 = module.gate_up_proj
    experts, _, hidden = w1.shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device=w1.device, dtype=w1.dtype)
    k = top_k(module)
    index = torch.rand(tokens, experts, generator=gen).topk(k, dim=-1).indices.to(w1.device)
    weights = (torch.rand(tokens, k, generator=gen) + 0.1).to(w1.device)
    return x, index, weights


@torch.inference_mode()
def probe_error(module: nn.Module, forward, seed: int = 0) -> float | None:
    """The largest difference between ``forward`` and ``module``'s own forward on a probe batch (random rows,
    each routed to k distinct random experts with random positive weights), as a share of the largest output;
    None where either cannot take the probe."""
    x, index, weights = routed_batch(module, PROBE_TOKENS, seed)
    try:
        want, got = module(x, index, weights), forward(x, index, weights)
    except Exception:  # noqa: BLE001 - a module of another signature (or one the kernel refuses) keeps its own
        return None
    if not isinstance(want, torch.Tensor) or want.shape != x.shape or got.shape != x.shape:
        return None
    scale = want.float().abs().max().clamp_min(1e-30)
    err = float((got.float() - want.float()).abs().max() / scale)
    return err if math.isfinite(err) else None


def gpu_ms(run, repeats: int = TUNE_REPEATS) -> float:
    """The median milliseconds of ``run()`` on the current CUDA stream, after one call that compiles."""
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def pick(timings: dict[int | None, float]) -> int | None:
    """The fastest of ``TILES`` by index where it beats the default (key None) by ``MIN_GAIN``, else None."""
    default = timings.get(None)
    tried = {i: ms for i, ms in timings.items() if i is not None}
    if default is None or not tried:
        return None
    best = min(tried, key=tried.get)
    return best if tried[best] <= default * (1 - MIN_GAIN) else None


@torch.inference_mode()
def choose_tiles(
    module: nn.Module, fused_experts, tokens: int, tiles: tuple[dict, ...] = TILES
) -> tuple[dict | None, dict]:
    """The tile set for ``module``'s batches of ``tokens`` tokens, and what was timed: None (vLLM's own
    choice) on the CPU, below ``TUNE_FROM`` tokens, outside bf16 / fp16, or where vLLM has tiles tuned for
    this shape and GPU; else ``time_tiles``' choice among ``tiles`` on a routed batch of the loop's size."""
    w1 = module.gate_up_proj
    report: dict = {"tokens": min(tokens, TUNE_TOKENS)}
    if tokens < TUNE_FROM:
        return None, report | {"skipped": f"batches of {tokens} tokens, under {TUNE_FROM}"}
    if w1.dtype not in (torch.bfloat16, torch.float16):
        return None, report | {"skipped": f"{str(w1.dtype).removeprefix('torch.')} experts, not bf16 or fp16"}
    if w1.device.type != "cuda":
        return None, report | {"skipped": "not on a GPU"}
    try:
        override = tile_override()
        if has_tuned_tiles(module):
            return None, report | {"skipped": "vLLM has tiles tuned for this shape and GPU"}
    except Exception:  # noqa: BLE001 - a vLLM without these: its own choice
        return None, report | {"skipped": "vLLM offers no tile override"}

    def timed() -> dict:
        batch = routed_batch(module, report["tokens"], seed=1)
        forward = fused_forward(module, fused_experts)
        return time_tiles(forward, batch, override, TOLERANCE[w1.dtype], tiles=tiles)[1]

    kept = remembered(tiles_file(), tiles_key(module, report["tokens"], tiles), timed)
    chosen = kept.get("chosen")
    return (tiles[chosen] if chosen is not None else None), report | kept


def experts_shape(module: nn.Module) -> str:
    """An experts module's shape as the tile choices name it: experts x 2I x H x I."""
    return "x".join(map(str, (*module.gate_up_proj.shape, module.down_proj.shape[-1])))


def tiles_file() -> Path | None:
    """Where this host keeps its tile choices: under vLLM's cache root (``VLLM_CACHE_ROOT``), or None."""
    try:
        from vllm import envs

        return Path(envs.VLLM_CACHE_ROOT) / TILES_FILE
    except Exception:  # noqa: BLE001 - a vLLM without it: every run times its tiles
        return None


def tiles_key(module: nn.Module, tokens: int, tiles: tuple[dict, ...]) -> str:
    """What a tile choice depends on: the GPU, vLLM's, Triton's and torch's versions, the experts' shape and
    dtype, the batch timed, and the sets tried (by hash)."""
    import triton
    import vllm

    w1 = module.gate_up_proj
    sets = hashlib.sha256(json.dumps(tiles, sort_keys=True).encode()).hexdigest()[:16]
    return " | ".join(
        [
            torch.cuda.get_device_name(w1.device),
            f"vllm {vllm.__version__}, triton {triton.__version__}, torch {torch.__version__}",
            f"{experts_shape(module)} {str(w1.dtype).removeprefix('torch.')}",
            f"{tokens} tokens",
            f"sets {sets}",
        ]
    )


def remembered(path: Path | None, key: str, compute: Callable[[], dict]) -> dict:
    """The report kept under ``key`` in ``path`` (a JSON object of reports), marked ``"kept": True``; else
    ``compute()``'s, then kept there (temp name, then rename). One process at a time looks and computes (a
    lock file beside it): the data-parallel workers of a host wait for the first one's choice and take it.
    A file that cannot be read is computed over; where it cannot be written (or locked) the report is
    computed and left unkept, with the reason in ``"not_kept"``."""
    if path is None:
        return compute() | {"not_kept": "vLLM names no cache root"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 - held across the computation
    except OSError as exc:
        return compute() | {"not_kept": f"{path}: {exc.strerror or exc}"}
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        known = known if isinstance(known, dict) else {}
        if isinstance(known.get(key), dict) and "chosen" in known[key]:
            return known[key] | {"kept": True}
        report = compute()
        try:
            write_json(path, known | {key: report})
        except OSError as exc:
            return report | {"not_kept": f"{path}: {exc.strerror or exc}"}
        return report


def time_tiles(
    forward, batch, override, tolerance: float, timer=gpu_ms, tiles: tuple[dict, ...] = TILES
) -> tuple[int | None, dict]:
    """Time ``forward(*batch)`` under vLLM's default tiles and under each of ``tiles`` (``override``: vLLM's
    ``override_config``; ``timer``: the milliseconds of a call); a set that fails (shared memory the GPU
    lacks, memory) is skipped. The choice (``pick``) must compute what the default computes, within
    ``tolerance`` of the largest output, or the default stays. Returns the index chosen (None: the default)
    and the timings."""
    timings: dict[int | None, float] = {}
    for i, tile_set in [(None, None), *enumerate(tiles)]:
        try:
            with override(tile_set):
                timings[i] = timer(lambda: forward(*batch))
        except Exception:  # noqa: BLE001 - tiles this GPU cannot run
            continue
    chosen = pick(timings)
    report: dict = {"default_ms": timings.get(None), "tiles_ms": [timings.get(i) for i in range(len(tiles))]}
    if chosen is not None:
        with override(None):
            want = forward(*batch).float()
        with override(tiles[chosen]):
            got = forward(*batch).float()
        report["error"] = err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
        if not (math.isfinite(err) and err <= tolerance):
            chosen = None
    return chosen, report | {"chosen": chosen}


def fuse(
    root: nn.Module, tokens: int = 0, tiles: tuple[dict, ...] | None = None
) -> tuple[list[str], float | None, dict]:
    """Give every proven experts module under ``root`` the fused forward, with the tiles ``choose_tiles``
    picks among ``tiles`` (None: ``TILES``; (): vLLM's own choice) for batches of ``tokens`` tokens (once per
    shape of experts): the names of the modules fused, the worst probe error among them (None when none was
    fused), and the tile timings by shape."""
    candidates_found = candidates(root)
    fused_experts = kernel() if candidates_found else None
    if fused_experts is None:
        return [], None, {}
    fused, worst, tuned = [], None, {}
    for name, module in candidates_found:
        shape = experts_shape(module)
        if shape not in tuned:
            tuned[shape] = choose_tiles(module, fused_experts, tokens, TILES if tiles is None else tiles)
        forward = fused_forward(module, fused_experts, tuned[shape][0])
        err = probe_error(module, forward)
        if err is not None and err <= TOLERANCE.get(module.gate_up_proj.dtype, 1e-4):
            module.forward = forward
            fused.append(name)
            worst = err if worst is None else max(worst, err)
    return fused, worst, {shape: report for shape, (_, report) in tuned.items()}
