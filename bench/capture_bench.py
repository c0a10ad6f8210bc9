"""Benchmark (issue #52): the vLLM extraction against the same engine's plain prefill, side by side.

For each shape (bench/gpu_models.py builds it on the GPU, or the tiny one on the CPU) one prepared set of
random conversations (bench/extract_bench.py's), then each row a fresh process on it, in this order:

* ``cold``: ``pipeline extract --backend vllm`` with every capture lever off (today's path) and empty compile
  caches; ``warm``: the same with ``cold``'s caches (a second run on a host: docs/benchmarks.md);
* ``plain``: the same engine (pipeline/backends/vllm.py's ``engine_arguments``: eager unless the run is long
  enough to compile, no prefix cache, no chunked prefill, token ids, the same step size, its core in the
  process) without the extraction: ``LLM.generate`` of every prompt, ``max_tokens=1``, nothing captured, with
  ``cold``'s caches: the ceiling;
* ``capture``: the same engine with vLLM's ``extract_hidden_states`` and a connector that copies nothing
  (bench/null_connector.py): what capturing into the drafter's cache costs the engine by itself;
* ``bulk``, ``pool``, ``thread``, ``steps``: ``warm`` with the capture levers switched on one after the
  other, each row adding one (pipeline/backends/vllm_connector.py: EAGLE_VLLM_BULK_COPY=1, then
  EAGLE_VLLM_PINNED_POOL=4, EAGLE_VLLM_CONNECTOR_THREAD=1, then EAGLE_VLLM_STEP_TOKENS=--step-tokens);
* ``hf``: ``pipeline extract --backend hf`` with its defaults and empty caches; ``hf-compiled``: the same
  with ``--compile on``, what ``--compile auto`` chooses for a dense model on runs of 4e16 decoder FLOPs and
  more (20.5M tokens of llama-1b, 2.9M of llama-8b: a real run's), its caches empty: its compile runs in the
  loop's first forwards and counts in its loop rate (the compiled loop's steady rate: bench/hf_levers.py);
  ``hf-compiled-warm``: the same with ``hf-compiled``'s caches (a second run on a host); ``hf-unfused``:
  ``hf`` with ``--fused-experts off``, an MoE's experts as transformers runs them; ``hf-fused``: ``hf`` with
  ``--fused-experts on``, its experts through vLLM's fused MoE kernel (pipeline/backends/fused_experts.py;
  what ``auto`` chooses on runs of 13M tokens and more), its caches empty; ``hf-fused-warm``: the same with
  ``hf-fused``'s caches (its Triton kernels compiled by the first run); ``hf-fused-w4``, ``hf-fused-w2``: the
  same with 4 and 2 writer threads instead of the default (whether the writers' threads hold back the thread
  that launches the forward's kernels: the fused hf extraction of dsv3-9b left its GPU 32-36% idle where the
  same kernels without files left it 1% idle, docs/benchmarks.md). A dense model has no experts: the fused
  rows are skipped there, and ``hf-unfused`` runs as ``hf`` does.

Each row's loop rate and its ratio to ``plain``; for the extraction rows where the difference goes: the engine
thread's seconds in our connector, the bytes copied off the GPU and the copy stream's seconds, the writer
threads' seconds waiting for states and writing them, the engine steps' count and sizes, and the GPU's busy
share over the loop (nvidia-smi's utilization.gpu sampled every 100 ms; hf's own device clock too). The JSON
is written after every row, so a run cut short keeps the rows it finished. Each row's set is removed after
it; each vllm extraction row's files are compared with the first one's by their sha256 (``same_files``:
bit-identical files where the engine ran the same steps, as on the CPU; a GPU's kernels depend on the step's
batch, so a count below all there is not by itself a difference of the levers:
tests/vllm/test_capture_levers.py holds them bit-identical on one engine).

On a GPU (llama-1b alone: ~5-6 minutes on an H100; the shapes, sets and rows are options):

    . .gpu/env.sh; python3 -m bench.capture_bench run --preset gpu --shapes llama-1b --samples 1024 \\
        --workdir /dev/shm/cb --json-out $OUT/capture-bench.json

``--trace DIR`` runs every extraction row through bench/loop_trace.py: torch's profiler over a window of its
loop's batches (``--trace-window SKIP,BATCHES``), its summary printed after the row and kept in the row's
``trace`` and in DIR/ROW-SHAPE.json; a traced row's loop rate is slowed by the window.

The CPU smoke run (tests/bench/test_capture_bench.py, the vLLM CPU build): ``make bench-capture``
(``run --preset tiny``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import click
import torch

from bench.e2e_bench import GpuMemory, cache_environment, run_ours, timed_process
from bench.extract_bench import make_prepared
from bench.gpu_models import build_model, save_model
from contract.experts import experts_met

ROWS = (
    "cold",
    "plain",
    "capture",
    "warm",
    "bulk",
    "pool",
    "thread",
    "steps",
    "hf",
    "hf-compiled",
    "hf-compiled-warm",
    "hf-unfused",
    "hf-fused",
    "hf-fused-warm",
    "hf-fused-w4",
    "hf-fused-w2",
)
# each hf row: the row whose compile caches it uses, and its extract flags beyond the backend
HF_ROWS = {
    "hf": ("hf", []),
    "hf-compiled": ("hf-compiled", ["--compile", "on"]),
    "hf-compiled-warm": ("hf-compiled", ["--compile", "on"]),
    "hf-unfused": ("hf", ["--fused-experts", "off"]),
    "hf-fused": ("hf-fused", ["--fused-experts", "on"]),
    "hf-fused-warm": ("hf-fused", ["--fused-experts", "on"]),
    "hf-fused-w4": ("hf-fused", ["--fused-experts", "on", "--writer-threads", "4"]),
    "hf-fused-w2": ("hf-fused", ["--fused-experts", "on", "--writer-threads", "2"]),
}
# an MoE's only: extract refuses --fused-experts on for a dense model
FUSED_ROWS = tuple(
    row for row, (_, flags) in HF_ROWS.items() if ("--fused-experts", "on") in zip(flags, flags[1:])
)
PRESETS = {
    # shape, samples, seq length; the tiny preset's rows are those the CPU build runs in a smoke test
    "gpu": dict(
        shapes="llama-1b,llama-8b,dsv3-9b", samples="1024,256,384", seq_length=2048, rows=",".join(ROWS)
    ),
    "tiny": dict(shapes="tiny", samples="12", seq_length=128, rows="cold,plain,capture,thread,hf,hf-fused"),
}
LEVERS = {  # each row's levers: the last row's plus one
    "bulk": {"EAGLE_VLLM_BULK_COPY": "1"},
    "pool": {"EAGLE_VLLM_BULK_COPY": "1", "EAGLE_VLLM_PINNED_POOL": "4"},
    "thread": {
        "EAGLE_VLLM_BULK_COPY": "1",
        "EAGLE_VLLM_PINNED_POOL": "4",
        "EAGLE_VLLM_CONNECTOR_THREAD": "1",
    },
}
OFF = {"EAGLE_VLLM_BULK_COPY": "0", "EAGLE_VLLM_PINNED_POOL": "0", "EAGLE_VLLM_CONNECTOR_THREAD": "0"}


def row_plan(row: str, step_tokens: int) -> tuple[str, str, dict[str, str]]:
    """A row's kind (extract / engine / hf), the row whose compile caches it uses, and its environment."""
    if row in ("cold", "warm"):
        return "extract", "cold", dict(OFF)
    if row in LEVERS:
        return "extract", "cold", {**OFF, **LEVERS[row]}
    if row == "steps":
        return "extract", "cold", {**OFF, **LEVERS["thread"], "EAGLE_VLLM_STEP_TOKENS": str(step_tokens)}
    if row in ("plain", "capture"):
        return "engine", "cold", dict(OFF)
    if row in HF_ROWS:
        return "hf", HF_ROWS[row][0], {}
    raise click.BadParameter(f"unknown row {row!r}: choose from {', '.join(ROWS)}", param_hint="--rows")


def run_engine(kind: str, prepared: Path, model: Path, cache: Path, env: dict[str, str]) -> dict:
    """The ``plain`` or ``capture`` row: this module's ``engine`` command as a fresh process."""
    env = cache_environment(cache, env)
    argv = [sys.executable, "-m", "bench.capture_bench", "engine", kind, str(prepared), str(model)]
    with GpuMemory() as mem:
        wall, lines = timed_process(argv, env)
    stats = json.loads(next(line for _, line in reversed(lines) if line.startswith('{"tokens"')))
    start = stats["loop_start_seconds"]
    print(f"{kind}: {wall:.1f} s; {stats['tokens_per_s']:,.0f} tok/s", flush=True)
    return {
        "wall_seconds": wall,
        "loop_tokens_per_s": stats["tokens_per_s"],
        "loop_seconds": stats["seconds"],
        "first_batch_seconds": start,
        "gpu_busy_share": mem.busy_share(start, start + stats["seconds"]),
        "peak_gpu_mib": mem.peak_mib,
        "stats": stats,
    }


def trace_window_of(value: str) -> tuple[int, int]:
    """``--trace-window``'s batches skipped and traced, or a usage error."""
    try:
        skip, batches = (int(x) for x in value.split(","))
    except ValueError:
        skip = batches = -1
    if skip < 0 or batches < 1:
        raise click.BadParameter(f"{value!r}: give SKIP,BATCHES (e.g. 8,6)", param_hint="--trace-window")
    return skip, batches


def trace_argv(out: Path, skip: int, batches: int) -> list[str]:
    """The extraction row run through bench/loop_trace.py, its window's summary into ``out``."""
    window = ["--skip", str(skip), "--batches", str(batches)]
    return ["-m", "bench.loop_trace", "record", "--out", str(out), *window, "--sync-debug", "--"]


def traced_window(path: Path) -> dict | None:
    """A traced row's window (bench/loop_trace.py's summary), printed; None where the row wrote none."""
    from bench import loop_trace

    if not path.exists():
        print(f"{path.stem}: no traced window (the loop ran fewer batches than --trace-window skips)")
        return None
    summary = json.loads(path.read_text())
    print("\n".join([f"{path.stem}, traced:", *loop_trace.lines(summary)]), flush=True)
    return summary


def where_it_goes(row: dict) -> dict:
    """The extraction row's breakdown out of its stats (the backend's figures, the writer's)."""
    stats = row.get("stats") or {}
    backend = stats.get("backend") or {}
    connector = backend.get("connector") or {}
    loop = stats.get("seconds") or 0.0
    out = {
        "loop_seconds": loop,
        "writer_ready_thread_seconds": stats.get("writer_ready_seconds"),
        "writer_write_thread_seconds": stats.get("writer_write_seconds"),
        "writer_wait_main_seconds": stats.get("writer_wait_seconds"),
        "writer_cpu_thread_seconds": stats.get("writer_cpu_seconds"),
        "main_thread_cpu_seconds": stats.get("main_thread_cpu_seconds"),
        "gpu_busy_share": row.get("gpu_busy_share"),
        "device_idle_own_clock": stats.get("device_idle_fraction"),
    }
    if connector:
        out.update(
            levers=connector["levers"],
            connector_engine_thread_seconds=connector["engine_thread_seconds"],
            connector_engine_thread_share=connector["engine_thread_seconds"] / loop if loop else None,
            connector_own_thread_seconds=connector["connector_thread_seconds"],
            gb_copied=connector["bytes_copied"] / 1e9,
            copy_stream_seconds=connector["copy_stream_seconds"],
            engine_steps=connector["engine_steps"],
            step_tokens_mean=connector["step_tokens_mean"],
            step_tokens_max=connector["step_tokens_max"],
            save_steps=connector["save_steps"],
            pool_allocated=connector["pool_allocated"],
            pool_misses=connector["pool_misses"],
        )
    if "inputs_seconds" in backend:  # the hf backend's host side: main-thread seconds queuing each part
        out.update(hf_host={k: v for k, v in backend.items() if k.endswith("_seconds") or k == "pinned_pool"})
    elif backend:
        out.update(
            max_num_batched_tokens=backend.get("max_num_batched_tokens"),
            engine_wait_thread_seconds=backend.get("engine_wait_seconds"),
            take_states_thread_seconds=backend.get("read_seconds"),
        )
    return out


def checksums(out: Path) -> dict[str, str]:
    from pipeline.ondisk import formats

    return {name: record.sha256 for name, record in formats.read_checksums(out).items()}


def table(results: dict) -> list[str]:
    """Markdown: each shape's rows, their loop rate against ``plain`` and where the time went (pure)."""
    lines = [
        "| shape | row | loop tok/s | vs plain | GPU busy | connector s (engine thread) | copy s | GB | "
        "writers ready / write s | steps (mean tokens) | same files |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for shape, r in results["shapes"].items():
        plain = (r["rows"].get("plain") or {}).get("loop_tokens_per_s")
        for name, x in r["rows"].items():
            w = x.get("where", {})

            def fmt(v, spec):
                return "-" if v is None else format(v, spec)

            lines.append(
                f"| {shape} | {name} | {x['loop_tokens_per_s']:,.0f} | "
                f"{fmt(x['loop_tokens_per_s'] / plain if plain else None, '.2f')} | "
                f"{fmt(x.get('gpu_busy_share'), '.0%')} | "
                f"{fmt(w.get('connector_engine_thread_seconds'), '.2f')} | "
                f"{fmt(w.get('copy_stream_seconds'), '.2f')} | {fmt(w.get('gb_copied'), '.1f')} | "
                f"{fmt(w.get('writer_ready_thread_seconds'), '.1f')} / "
                f"{fmt(w.get('writer_write_thread_seconds'), '.1f')} | "
                f"{fmt(w.get('engine_steps'), 'd')} ({fmt(w.get('step_tokens_mean'), ',.0f')}) | "
                + (f"{f['same']}/{f['files']} as {f['as']} |" if (f := x.get("same_files")) else "- |")
            )
    return lines


@click.group(invoke_without_command=False)
def cli() -> None:
    """The capture benchmark (``run``) and its engine rows (``engine``, one process each)."""


@cli.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="gpu", show_default=True)
@click.option("--shapes", default=None, help="bench/gpu_models.py shapes (default: the preset's).")
@click.option("--samples", default=None, help="Conversations per shape, in --shapes order (or one for all).")
@click.option("--seq-length", type=int, default=None)
@click.option(
    "--rows", default=None, help=f"Rows to run, in this order (default: the preset's): {','.join(ROWS)}"
)
@click.option(
    "--step-tokens",
    type=int,
    default=16384,
    show_default=True,
    help="The `steps` row's engine step (tokens).",
)
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("/dev/shm/capture-bench"))
@click.option("--json-out", type=click.Path(path_type=Path), required=True)
@click.option(
    "--trace",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Trace a window of every extraction row's loop (bench/loop_trace.py, --sync-debug) into "
    "DIR/ROW-SHAPE.json; a traced row's tok/s is slowed by it.",
)
@click.option(
    "--trace-window",
    default="8,6",
    show_default=True,
    help="The traced window: batches skipped, batches traced.",
)
def run(
    preset: str,
    shapes: str | None,
    samples: str | None,
    seq_length: int | None,
    rows: str | None,
    step_tokens: int,
    workdir: Path,
    json_out: Path,
    trace: Path | None,
    trace_window: str,
) -> None:
    """Every row on each shape's set, side by side (module docstring)."""
    skip, batches_traced = trace_window_of(trace_window)
    p = PRESETS[preset]
    shape_list = (shapes or p["shapes"]).split(",")
    counts = [int(c) for c in (samples or p["samples"]).split(",")]
    if len(counts) == 1:
        counts *= len(shape_list)
    row_list = (rows or p["rows"]).split(",")
    for row in row_list:
        row_plan(row, step_tokens)  # an unknown row stops here, before anything is built
    seq = seq_length or p["seq_length"]
    gpu = torch.cuda.is_available()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    results: dict = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "preset": preset,
        "step_tokens": step_tokens,
        "shapes": {},
    }

    def save() -> None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_out.with_name(json_out.name + ".tmp")
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        tmp.replace(json_out)

    for shape, n in zip(shape_list, counts, strict=True):
        t0 = time.perf_counter()
        model = build_model(shape, "cuda" if gpu else "cpu")
        model_dir = save_model(model, workdir / f"model-{shape}")
        vocab = model.config.vocab_size
        moe = experts_met(model.config.to_dict()) != (0, 0)
        del model
        if gpu:
            torch.cuda.empty_cache()
        prepared = workdir / f"prepared-{shape}"
        make_prepared(prepared, n, seq, vocab)
        from pipeline.ondisk import formats

        tokens = int(sum(formats.read_prepared(prepared)[0].lengths()))
        entry = results["shapes"][shape] = {
            "samples": n,
            "tokens": tokens,
            "build_seconds": time.perf_counter() - t0,
            "rows": {},
        }
        first: tuple[str, dict[str, str]] | None = None  # the first vllm extraction row's files
        for row in row_list:
            if row in FUSED_ROWS and not moe:
                print(f"{row}-{shape}: skipped (a dense model has no experts to fuse)", flush=True)
                continue
            kind, cache_of, env = row_plan(row, step_tokens)
            cache = workdir / f"cache-{cache_of}-{shape}"
            out = workdir / f"{row}-{shape}"
            if kind == "engine":
                result = run_engine(row, prepared, model_dir, cache, env)
            else:
                backend = "vllm" if kind == "extract" else "hf"
                traced = None if trace is None else trace / f"{row}-{shape}.json"
                result = run_ours(
                    prepared,
                    model_dir,
                    out,
                    ["--backend", backend, "--json-stats", *HF_ROWS.get(row, ("", []))[1]],
                    cache,
                    row_env=env,
                    checks=False,
                    wrapper=None if traced is None else trace_argv(traced, skip, batches_traced),
                )
                result["where"] = where_it_goes(result)
                if traced is not None:
                    result["trace"] = traced_window(traced)
                if kind == "extract":
                    sums = checksums(out)
                    first = first or (row, sums)
                    same = sum(first[1].get(k) == v for k, v in sums.items() if k.startswith("data_"))
                    result["same_files"] = {
                        "as": first[0],
                        "same": same,
                        "files": sum(k.startswith("data_") for k in sums),
                    }
                shutil.rmtree(out, ignore_errors=True)
            entry["rows"][row] = result
            plain = (entry["rows"].get("plain") or {}).get("loop_tokens_per_s")
            if plain:
                for x in entry["rows"].values():
                    x["vs_plain"] = x["loop_tokens_per_s"] / plain
            save()  # after every row: a run cut short keeps what it did
    print("\n".join(["", *table(results)]), flush=True)
    save()


@cli.command(hidden=True)
@click.argument("kind", type=click.Choice(["plain", "capture"]))
@click.argument("prepared", type=click.Path(exists=True, path_type=Path))
@click.argument("model", type=click.Path(exists=True, path_type=Path))
def engine(kind: str, prepared: Path, model: Path) -> None:
    """One engine row: the extraction's engine on the set's prompts, all at once, one token each; prints its
    figures as one JSON line."""
    from pipeline.extract.loop import process_age

    llm, params, prompts = build_engine(kind, prepared, model)
    loop_start = process_age()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    if len(outputs) != len(prompts) or any(not o.finished for o in outputs):
        raise SystemExit(f"{kind}: {len(outputs)} outputs for {len(prompts)} prompts")
    tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    figures = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "kind": kind}
    figures["loop_start_seconds"] = loop_start
    if kind == "capture":
        from pipeline.backends.vllm_connector import STATS

        figures["connector"] = STATS.figures()
    llm.llm_engine.engine_core.shutdown()
    click.echo(json.dumps(figures))
    sys.stdout.flush()
    os._exit(0)  # no teardown of the engine's threads: the figures are out


def build_engine(kind: str, prepared: Path, model: Path):
    """The extraction's engine (``plain``: without extract_hidden_states and its connector; ``capture``: with
    them, copying nothing), its sampling parameters and the set's prompts."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import contextlib

    from bench import null_connector
    from pipeline.backends import vllm as vb
    from pipeline.backends.base import BackendOptions, visible_device_count
    from pipeline.model.layers import default_layer_ids
    from pipeline.model.modeldir import read_model_dir
    from pipeline.ondisk import formats
    from pipeline.runtime import vllm_cpu

    samples, meta = formats.read_prepared(prepared)
    prompts = [TokensPrompt(prompt_token_ids=samples.ids(i).tolist()) for i in range(len(samples.lengths()))]
    mdir = read_model_dir(model)
    options = BackendOptions(
        model=mdir,
        layer_ids=tuple(default_layer_ids(mdir.num_layers)),
        seq_length=meta.seq_length,
        planned_tokens=int(sum(samples.lengths())),
    )
    devices = visible_device_count()
    if devices == 0:
        os.environ.update(vllm_cpu.extraction_environment(1))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    storage = Path(os.environ.get("TMPDIR", "/tmp")) / f"capture-bench-{os.getpid()}"
    compiled = vb.should_compile(options, on_gpu=devices > 0)
    args = vb.engine_arguments(options, 1, storage, compiled, vb.step_tokens(os.environ))
    if kind == "plain":
        del args["speculative_config"], args["kv_transfer_config"]
    else:
        args["kv_transfer_config"].update(
            kv_connector=null_connector.NAME, kv_connector_module_path=null_connector.MODULE
        )
    if devices == 0:
        args.update(vllm_cpu.engine_arguments(args["dtype"]))
    with contextlib.ExitStack() as stack:
        stack.enter_context(vb.engine_process(in_process=True))
        stack.enter_context(vb.model_inspection_here())
        llm = LLM(**args)
    return llm, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), prompts


if __name__ == "__main__":
    cli()
