"""Benchmark: the hf backend's speed levers, one at a time, side by side on one model in one process.

For each model shape (built on the GPU, never saved), every variant of the backend runs the same samples
(random ids, lengths uniform in [seq/2, seq)) through ``capture_async`` as the extract loop does (the next
batch queued before the previous batch's copies are waited for; no files): padded vs. packed batches,
eager vs. ``torch.compile``d layers, eager RMSNorms vs. torch's fused kernel
(pipeline/backends/fused_norms.py), an MoE's experts as transformers runs them vs. vLLM's fused MoE kernel
(``-fx``: pipeline/backends/fused_experts.py, with the tiles it times; ``-fxv``: with vLLM's own tiles),
and several ``max_batch_tokens``; and, as ``pipeline extract`` runs it, the same loop with every sample
written to a file by the extract loop's writer threads (``FILES``: ``-files``, ``-files-w2``). Each variant
reports tokens/s, the decoder roofline fraction (bench/roofline.py), the device's busy time, its first two
batches' seconds (compilation included) and its worst relative error against the plain backend run one
sample at a time.
CUDA graphs are measured at one recurring shape: the first batch's forward, eager or compiled, launched
as it is and replayed from a captured graph.

On an MoE shape, ``--experts`` runs each variant once per transformers experts implementation (``eager``:
one matmul per expert hit; ``grouped_mm``, transformers' default; ``batched_mm``, which gathers each token's
expert weights: for decode-sized batches only), named ``variant@impl``; ``--variants`` may name such pairs
itself.
``--profile`` records the timed loop's kernels with torch's profiler: each row gets its device time by kind
of kernel (``kernel_ms``: matmul, grouped matmul, attention, norm, routing, copies, the rest) and its 12
costliest kernels.

    python -m bench.hf_levers --shapes llama-1b,llama-8b --json-out levers.json
    python -m bench.hf_levers --shapes dsv3-9b --samples 384 --profile --json-out moe-levers.json \
        --variants packed-32k@grouped_mm,packed-32k@eager,plain-32k@grouped_mm,packed-compiled-32k@grouped_mm
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import torch

from bench.gpu_models import build_model
from bench.roofline import DecoderShape
from pipeline.model.experts import is_decoder_param, is_routed_expert_param

# name: (packed, compile, max_batch_tokens, fused RMSNorms, an MoE's experts fused: True with the tiles the
# backend times (fused_experts.choose_tiles), "vllm-tiles" with vLLM's own choice of tiles)
VARIANTS = {
    "plain-16k": (False, False, 16384, False, False),
    "plain-32k": (False, False, 32768, False, False),
    "plain-64k": (False, False, 65536, False, False),
    "plain-fused-32k": (False, False, 32768, True, False),
    "plain-fused-fx-32k": (False, False, 32768, True, True),
    "plain-fused-fx-64k": (False, False, 65536, True, True),
    "plain-fused-fxv-32k": (False, False, 32768, True, "vllm-tiles"),
    "plain-fused-fxv-64k": (False, False, 65536, True, "vllm-tiles"),
    "packed-32k": (True, False, 32768, False, False),
    "packed-fused-32k": (True, False, 32768, True, False),
    "compiled-32k": (False, True, 32768, False, False),
    "packed-compiled-16k": (True, True, 16384, False, False),
    "packed-compiled-32k": (True, True, 32768, False, False),
    "packed-compiled-64k": (True, True, 65536, False, False),
}


# name: (the variant whose backend it runs, writer threads): the same loop with each sample written to a file
# by the extract loop's Writer (pipeline/extract/writer.py, in a temporary folder of /dev/shm), as
# ``pipeline extract`` does; side by side with the variant without files, it isolates what writing costs the
# loop (the thread that launches the forward's kernels shares the GIL with the writers)
FILES = {
    "plain-32k-files": ("plain-32k", 8),
    "plain-fused-fx-32k-files": ("plain-fused-fx-32k", 8),
    "plain-fused-fx-32k-files-w2": ("plain-fused-fx-32k", 2),
}


class _Dir:
    """What BackendOptions needs of a model directory, for a model that has none."""

    def __init__(self, model):
        self.num_layers = model.config.num_hidden_layers
        self.path = None


def samples(n: int, seq_length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, vocab, size=int(t)).tolist()
        for t in rng.integers(seq_length // 2, seq_length, size=n)
    ]


def backend_for(
    model,
    packed: bool,
    compiled: bool,
    max_batch_tokens: int,
    fused: bool = False,
    fused_experts: bool = False,
    expert_tiles: tuple | None = None,
):
    from pipeline.backends.base import BackendOptions
    from pipeline.backends.hf import HFBackend

    L = model.config.num_hidden_layers
    options = BackendOptions(
        model=_Dir(model),
        layer_ids=(2, L // 2, L - 3, L - 1),
        device=str(model.device),
        max_batch_tokens=max_batch_tokens,
        packed=packed,
        compile=compiled,
        fused_norms=fused,
        fused_experts=fused_experts,
        expert_tiles=expert_tiles,
    )
    return HFBackend(options, model=model)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_loop(backend, seqs: list[list[int]], batches, files: int = 0) -> tuple[float, float, int]:
    """Wall seconds, device-busy seconds and files written of capturing every batch the way the extract loop
    does: the next batch queued before the previous one is waited for; with ``files`` writer threads, each
    batch's samples handed then to the extract loop's Writer (in a temporary folder of /dev/shm), and the
    loop ends when the last file is written."""
    from pipeline.extract.writer import Writer

    shm = Path("/dev/shm")
    out = Path(tempfile.mkdtemp(prefix="hf-levers-", dir=shm if shm.is_dir() else None)) if files else None
    try:
        _sync()
        busy0 = backend.clock.seconds
        t0 = time.perf_counter()
        writer = Writer(out, threads=files) if files else None
        previous = None
        for b in batches:
            batch = [seqs[i] for i in b.indices]
            captured = backend.capture_async(batch)
            if writer is not None:
                writer.put(previous or [])
                previous = samples_of(b, batch, captured)
            else:
                if previous is not None:
                    previous.ready()
                previous = captured
        if writer is not None:
            writer.put(previous)
            writer.close()
        else:
            previous.ready()
        _sync()
        return (
            time.perf_counter() - t0,
            backend.clock.seconds - busy0,
            writer.written if writer is not None else 0,
        )
    finally:
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)


def samples_of(b, batch: list[list[int]], captured) -> list:
    """The Writer's items for one captured batch, as the extract loop makes them (a mask of ones)."""
    from pipeline.extract.writer import Sample

    scales = captured.scales or [None] * len(batch)
    return [
        Sample(i, torch.tensor(s), states, torch.ones(len(s), dtype=torch.long), captured.ready_of(k), sc)
        for k, (i, s, states, sc) in enumerate(zip(b.indices, batch, captured.states, scales, strict=True))
    ]


def layer_errors(states, reference) -> list[float]:
    """Per captured layer, the worst relative error (Frobenius, per sample) of ``states`` against
    ``reference``."""
    return [
        max(
            float((got[j].float() - want[j].float()).norm() / want[j].float().norm())
            for got, want in zip(states, reference, strict=True)
        )
        for j in range(len(reference[0]))
    ]


def one_by_one(model, probe: list[list[int]]) -> list[list[torch.Tensor]]:
    """The plain backend's states, one sample at a time: the reference every variant is held to."""
    plain = backend_for(model, False, False, 16384)
    try:
        return [plain.capture([s])[0] for s in probe]
    finally:
        plain.close()


def graph_gain(backend, batch: list[list[int]], repeats: int = 5) -> dict:
    """ms of one forward of ``batch`` launched op by op, and replayed from a CUDA graph of it."""
    kwargs, _ = backend.inputs(batch)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / repeats * 1e3

    with torch.inference_mode():
        launched = timed(lambda: backend.decoder(**kwargs))
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            backend.decoder(**kwargs)  # warm-up on a side stream, as capture requires
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            backend.decoder(**kwargs)
        replayed = timed(graph.replay)
    del graph
    return {"launched_ms": launched, "graph_ms": replayed, "graph_gain": launched / replayed}


# a kernel's kind, by the first pattern its name contains (lower case); the rest is "other"
KERNEL_KINDS = (
    ("grouped matmul", ("grouped", "groupproblem", "group_gemm", "moe")),  # torch's CUTLASS grouped GEMM
    ("attention", ("flash", "fmha", "attention", "softmax")),
    ("matmul", ("gemm", "xmma", "cutlass", "cublas", "nvjet", "matmul", "aten::mm", "aten::bmm", "addmm")),
    ("norm", ("norm", "rsqrt", "pow_")),
    ("routing", ("topk", "sort", "histc", "histogram", "cumsum", "scatter", "gather", "index", "radix")),
    ("copies", ("memcpy", "memset", "copy", "cat")),
)


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in lower for k in keys)), "other")


def kernel_profile(events, top: int = 12) -> dict:
    """Device time by kind of kernel, and the ``top`` costliest kernels, from a profiler's
    ``key_averages()`` (CUDA kernels only; on the CPU, the ops' own CPU time)."""
    from torch.autograd import DeviceType

    gpu = any(e.device_type == DeviceType.CUDA for e in events)
    rows = []
    for e in events:
        # on a GPU the kernels alone (an aten op's device time is its kernels': counted once, as kernels);
        # on the CPU each op's own time
        if gpu and e.device_type != DeviceType.CUDA:
            continue
        ms = (e.self_device_time_total if gpu else e.self_cpu_time_total) / 1e3
        if ms > 0:
            rows.append((e.key, ms, e.count))
    by_kind: dict[str, float] = {}
    for key, ms, _ in rows:
        kind = kernel_kind(key)
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
    rows.sort(key=lambda r: -r[1])
    return {
        "kernel_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"name": k[:120], "ms": round(ms, 2), "calls": n} for k, ms, n in rows[:top]],
    }


def profiled_loop(backend, seqs, batches, gpu: bool, files: int = 0) -> dict:
    """``run_loop`` under torch's profiler: its kernels by kind (``kernel_profile``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        run_loop(backend, seqs, batches, files)
    return kernel_profile(prof.key_averages())


def split_name(name: str) -> tuple[str, str | None]:
    """``variant@experts`` into the variant and the experts implementation (None: the model's own)."""
    variant, _, experts = name.partition("@")
    if variant not in VARIANTS and variant not in FILES:
        raise click.BadParameter(f"unknown variant {variant!r}: choose from {', '.join([*VARIANTS, *FILES])}")
    return variant, experts or None


def measure(
    model, name: str, seqs, probe, reference, fp32, roof: DecoderShape, gpu: bool, profiled: bool = False
) -> dict:
    """One variant's figures (see the module docstring)."""
    from torch._dynamo.utils import counters

    from pipeline.extract.plan import plan_batches

    variant, experts = split_name(name)
    variant, files = FILES.get(variant, (variant, 0))
    packed, compiled, mbt, fused, fx = VARIANTS[variant]
    if experts is not None:
        model.set_experts_implementation(experts)
    lengths = [len(s) for s in seqs]
    backend = backend_for(model, packed, compiled, mbt, fused, bool(fx), () if fx == "vllm-tiles" else None)
    try:
        batches = plan_batches(lengths, mbt, 64)
        graphs0 = counters["stats"]["unique_graphs"]
        t1 = time.perf_counter()
        run_loop(backend, seqs, batches[:2], files)  # compiles (when compiled), first shapes
        first = time.perf_counter() - t1
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        wall, busy, written = run_loop(backend, seqs, batches, files)
        peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else None
        states = backend.capture(probe)
        err = max(layer_errors(states, reference))
        fp32_err = layer_errors(states, fp32) if fp32 is not None else None
        row = {
            "packed": packed,
            "compiled": compiled,
            "max_batch_tokens": mbt,
            "fused_norms": len(backend.fused_norms),
            "fused_experts": len(backend.fused_experts),
            "fused_experts_probe_error": backend.fused_experts_error,
            "fused_experts_seconds": backend.startup.get("fused_experts_seconds"),
            "fused_experts_tiles": backend.fused_experts_tiles,
            "batches": len(batches),
            "writer_threads": files,
            "files_written": written,
            "first_two_batches_seconds": first,
            "tokens_per_s": sum(lengths) / wall,
            "roofline": roof.roofline_fraction(lengths, wall),
            "busy_roofline": roof.roofline_fraction(lengths, busy),
            "device_idle": 1 - busy / wall,
            "worst_rel_err_vs_one_by_one": err,
            "rel_err_vs_fp32_per_layer": fp32_err,
            "peak_gpu_gib": peak,
            "graphs_compiled": counters["stats"]["unique_graphs"] - graphs0,
            "experts_implementation": getattr(model.config, "_experts_implementation", None),
        }
        if profiled:
            row.update(profiled_loop(backend, seqs, batches, gpu, files))
        if gpu and variant in ("plain-32k", "packed-compiled-32k"):
            try:
                row.update(graph_gain(backend, [seqs[i] for i in batches[0].indices]))
            except Exception as exc:  # noqa: BLE001 - a lever that cannot be measured is reported, not fatal
                row["graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return row
    finally:
        backend.close()
        if gpu:
            torch.cuda.empty_cache()


@click.command()
@click.option("--shapes", default="llama-1b,llama-8b", show_default=True)
@click.option("--variants", default=",".join(VARIANTS), show_default=True, help=f"Also: {', '.join(FILES)}.")
@click.option(
    "--samples", "counts", default="256,96", show_default=True, help="Samples per shape, in --shapes order."
)
@click.option("--seq-length", type=int, default=2048, show_default=True)
@click.option(
    "--fp32-reference/--no-fp32-reference",
    default=False,
    show_default=True,
    help="Also hold every variant (and plain bf16) to an fp32 copy of the model, one sample at a time.",
)
@click.option(
    "--experts",
    default=None,
    help="An MoE's experts implementations (transformers': eager, grouped_mm, batched_mm), each variant "
    "run once per one (default: the model's own).",
)
@click.option("--profile", "profiled", is_flag=True, help="Each row's kernels by kind (torch's profiler).")
@click.option("--json-out", type=click.Path(), default=None)
def main(
    shapes: str,
    variants: str,
    counts: str,
    seq_length: int,
    fp32_reference: bool,
    experts: str | None,
    profiled: bool,
    json_out: str | None,
) -> None:
    names = variants.split(",")
    if experts:
        names = [f"{v}@{e}" for v in names for e in experts.split(",")]
    for name in names:
        split_name(name)  # an unknown variant stops here, before a model is built
    gpu = torch.cuda.is_available()
    results = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "shapes": {},
    }
    for shape, n in zip(shapes.split(","), [int(c) for c in counts.split(",")], strict=True):
        t0 = time.perf_counter()
        model = build_model(shape, "cuda" if gpu else "cpu")
        built = time.perf_counter() - t0
        cfg = model.config
        roof = DecoderShape.from_config(
            cfg.to_dict(),
            sum(p.numel() for k, p in model.named_parameters() if is_decoder_param(k)),
            sum(p.numel() for k, p in model.named_parameters() if is_routed_expert_param(k)),
        )
        seqs = samples(n, seq_length, cfg.vocab_size)
        lengths = [len(s) for s in seqs]
        probe = seqs[:4]
        reference = one_by_one(model, probe)
        fp32 = None
        if fp32_reference:  # how far bf16 itself is from fp32, so that each variant's error has a scale
            exact = copy.deepcopy(model).float()
            fp32 = one_by_one(exact, probe)
            del exact
        out = results["shapes"][shape] = {
            "build_seconds": built,
            "samples": n,
            "tokens": sum(lengths),
            "decoder_params": roof.decoder_params,
            "variants": {},
            "plain_bf16_vs_fp32_per_layer": layer_errors(reference, fp32) if fp32 else None,
        }
        own = getattr(model.config, "_experts_implementation", None)
        for name in names:
            try:
                row = measure(model, name, seqs, probe, reference, fp32, roof, gpu, profiled)
            except Exception as exc:  # noqa: BLE001 - one broken lever is reported, the others still run
                row = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            if own is not None:
                model.set_experts_implementation(own)
            out["variants"][name] = row
            print(
                json.dumps(
                    {
                        "shape": shape,
                        "variant": name,
                        **{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
                    }
                ),
                flush=True,
            )
        del model
        if gpu:
            torch.cuda.empty_cache()
    print(
        "\n| shape | variant | tok/s | decoder roofline | busy roofline | idle | "
        "first 2 batches s | rel err |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for shape, out in results["shapes"].items():
        for name, r in out["variants"].items():
            if "error" in r:
                print(f"| {shape} | {name} | {r['error'][:80]} | | | | | |")
                continue
            print(
                f"| {shape} | {name} | {r['tokens_per_s']:,.0f} | {r['roofline']:.1%} | "
                f"{r['busy_roofline']:.1%} | {r['device_idle']:.1%} | {r['first_two_batches_seconds']:.1f} | "
                f"{r['worst_rel_err_vs_one_by_one']:.2g} |"
            )
    if profiled:
        kinds = [k for k, _ in KERNEL_KINDS] + ["other"]
        print("\n| shape | variant | " + " | ".join(f"{k} ms" for k in kinds) + " |")
        print("|---|---|" + "---:|" * len(kinds))
        for shape, out in results["shapes"].items():
            for name, r in out["variants"].items():
                if "kernel_ms" in r:
                    cells = " | ".join(f"{r['kernel_ms'].get(k, 0.0):,.0f}" for k in kinds)
                    print(f"| {shape} | {name} | {cells} |")
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        with open(json_out, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
