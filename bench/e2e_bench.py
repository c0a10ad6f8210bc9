"""Benchmark: the product's `pipeline extract` against the naive script, whole processes, side by side.

For each model shape: build the model on the GPU and save it (bench/gpu_models.py), write a prepared set of
random conversations (lengths uniform in [seq/2, seq)), then run, each as a fresh process on the same set,
``python -m pipeline extract`` with its default flags (closing verification included) and
``python -m bench.naive_extract`` (one conversation at a time). Reports, for both: whole-process seconds,
loop tokens/s, the decoder roofline fraction of the loop (bench/roofline.py), peak GPU memory (nvidia-smi,
sampled every 100 ms: the process's whole footprint, CUDA context and allocator cache included) and write
bandwidth; for extract also its own start-up figures, how long the closing verification took (the whole tail
after its closing line, and the check's own seconds from its summary.json), and both closing checks timed
again on its set (``closing_check_seconds``: "record", the default, judges the writer's record and stats each
file; "full" reads every byte back, as ``pipeline verify`` does; the page cache as the run left it). Holds
both runs' states to an fp32 copy of the model (first 4 samples, ``accuracy``) and exits non-zero when ours is
further from it than the naive script; the plain relative difference between the two is reported too.

    python -m bench.e2e_bench --shapes llama-1b,llama-8b --samples 256,128 --workdir /dev/shm/e2e
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
import torch

from bench.extract_bench import agreement, make_prepared
from bench.gpu_models import build_model, save_model
from bench.roofline import model_shape
from bench.timing import timed
from pipeline.ondisk import formats

CLOSING = re.compile(
    r"extracted (\d+) samples .*?; ([\d,]+) tok/s(?:, device idle (\d+)%)?"
    r"(?:; first batch ([\d.]+) s after start, model load ([\d.]+) s)?"
)


class GpuMemory:
    """The peak of nvidia-smi's memory.used (MiB) on GPU 0 while it runs; None without nvidia-smi. Also keeps
    each sample's utilization.gpu (the share of nvidia-smi's last sample period in which a kernel ran) with
    its second since the start (``utilization``): a run's GPU busy share over a window (``busy_share``)."""

    def __init__(self):
        self.peak_mib: int | None = None
        self.utilization: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._t0 = time.perf_counter()

    def _sample(self) -> None:
        query = "--query-gpu=memory.used,utilization.gpu"
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", query, "--format=csv,noheader,nounits", "-i", "0"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                    check=False,
                ).stdout
                used, util = (int(x) for x in out.replace(",", " ").split()[:2])
                self.peak_mib = max(self.peak_mib or 0, used)
                self.utilization.append((time.perf_counter() - self._t0, util))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return
            self._stop.wait(0.1)

    def busy_share(self, start: float, end: float) -> float | None:
        """The mean utilization.gpu of the samples taken in [start, end] seconds since the start, as a
        fraction; None without samples there."""
        inside = [u for t, u in self.utilization if start <= t <= end]
        return sum(inside) / len(inside) / 100 if inside else None

    def __enter__(self) -> GpuMemory:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def timed_process(
    argv: list[str], env: dict | None = None, cwd: Path | None = None
) -> tuple[float, list[tuple[float, str]]]:
    """Run ``argv`` (bench/timing.py); its wall seconds and its output lines, each with the seconds since its
    start. A failed run stops the bench with its last lines."""
    run = timed(argv, env=env, cwd=cwd)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} exited {run.returncode}:\n{run.tail()}")
    return run.wall, run.lines


def accuracy(
    shape: str, model_dir: Path, prepared: Path, runs: dict[str, Path], n: int = 4
) -> dict[str, list[float]]:
    """Per layer stored pre-norm by both (the first 3), each run's worst relative error over its first ``n``
    samples against an fp32 copy of the model run one sample at a time: bf16 runs differ from each other by
    rounding that deep random layers amplify, so each is held to the exact answer instead of to the other."""
    from safetensors import safe_open

    from bench.hf_levers import layer_errors, one_by_one
    from pipeline.ondisk import formats

    model = build_model(shape, "cuda" if torch.cuda.is_available() else "cpu")  # same seed: the saved weights
    name, param = next((k, p) for k, p in model.named_parameters() if "layers.1." in k)
    with safe_open(_shard_of(model_dir, name), "pt") as fh:
        if not torch.equal(fh.get_tensor(name).to(param.device), param):
            raise SystemExit(f"rebuilding {shape} did not give the saved weights ({name} differs)")
    samples, _ = formats.read_prepared(prepared)
    probe = [samples.ids(i).tolist() for i in range(n)]
    exact = one_by_one(model.float(), probe)
    del model
    reference = [states[:3] for states in exact]
    return {
        who: layer_errors(
            [formats.read_sample(formats.data_file(d, i))["hidden_states"][:3] for i in range(n)], reference
        )
        for who, d in runs.items()
    }


def _shard_of(model_dir: Path, name: str) -> str:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return str(model_dir / json.loads(index.read_text())["weight_map"][name])
    return str(model_dir / "model.safetensors")


def dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("data_*.pt"))


COMPARED = 16  # ours' files the comparisons read (agreement: the first 16; accuracy: the first 4)


def keep_compared(out: Path, keep: int = COMPARED) -> int:
    """Delete the data files of ``out`` past the first ``keep`` once its figures are taken, so that the
    naive run's set, not two whole sets, is what memory holds next (llama-1b writes 16 KiB of states per
    token: 91 GB at 5.5M tokens). Returns the bytes freed."""
    freed = 0
    for index in formats.existing_data_indices(out)[keep:]:
        path = formats.data_file(out, index)
        freed += path.stat().st_size
        path.unlink()
    return freed


# vLLM's own log lines that time its start (weights, profiling, KV cache, compile, warm-up), kept with the
# second of the run at which each was printed: where an engine's start-up goes
# (vLLM 0.32 prefixes each with its process: "(MainProcess pid=7) INFO 12-03 21:15:57 [file.py:12] ...")
ENGINE_TIMING = re.compile(
    r"\b(INFO|WARNING) \d\d-\d\d [\d:]+ .*\b(took|seconds|[Ll]oading|KV cache|[Cc]ompil|[Ww]arm)"
)


def cache_environment(cache: Path, row_env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with ``row_env`` and every compile cache under ``cache``. Compiled kernels
    are cached on disk between runs: a fresh folder is a fresh machine's caches, another row's folder its warm
    ones. HOME too, as the stage container's (compose.yaml: HOME=/cache/home): libraries that cache under
    ~/.cache start cold."""
    (cache / "home").mkdir(parents=True, exist_ok=True)
    return dict(
        os.environ,
        **(row_env or {}),
        HOME=str(cache / "home"),
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
        TRITON_CACHE_DIR=str(cache / "triton"),
        VLLM_CACHE_ROOT=str(cache / "vllm"),
    )


def extract_argv(
    prepared: Path, model: Path, out: Path, extra: list[str], wrapper: list[str] | None = None
) -> list[str]:
    """The command line of one `pipeline extract` row (no progress bar; ``extra`` last), run through
    ``wrapper`` (``-m MODULE ARGS... --``) where one is given."""
    argv = [sys.executable, *(wrapper or []), "-m", "pipeline", "extract", "--prepared", str(prepared)]
    return [*argv, "--model", str(model), "--out", str(out), "--no-progress", *extra]


def run_ours(
    prepared: Path,
    model: Path,
    out: Path,
    extra: list[str],
    cache: Path,
    tree: Path | None = None,
    row_env: dict[str, str] | None = None,
    wrapper: list[str] | None = None,
    checks: bool = True,
) -> dict:
    """`pipeline extract` with its defaults (plus ``extra``, with ``row_env`` in its environment) as a fresh
    process, from this checkout or, with ``tree``, from another source tree (the baseline: its own pipeline/
    and contract/ come first); with ``wrapper`` (``-m MODULE ARGS... --``), run through that module:
    bench/stacks.py's sampler, bench/loop_trace.py's window. ``checks``: time both closing checks again on
    its set afterwards. With ``--json-stats`` among ``extra`` the run prints its figures instead of the
    closing line (and runs no closing check): they are returned as ``stats``, and the GPU's busy share over
    its loop as ``gpu_busy_share``."""
    env = cache_environment(cache, row_env)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree.resolve()), env.get("PYTHONPATH", "")])
    with GpuMemory() as mem:
        wall, lines = timed_process(extract_argv(prepared, model, out, extra, wrapper), env, cwd=tree)
    stats = next((json.loads(line) for _, line in reversed(lines) if line.startswith('{"tokens"')), None)
    if stats is not None:
        return stats_row(stats, wall, lines, mem, out, cache)
    found = [(t, CLOSING.search(line)) for t, line in lines if CLOSING.search(line)]
    if not found:
        raise SystemExit(
            "pipeline extract printed no closing line:\n" + "\n".join(line for _, line in lines[-10:])
        )
    at, m = found[-1]
    tps = float(m.group(2).replace(",", ""))
    # said at once, so that a run cut short still shows the rows it finished
    print(
        f"{out.name}: {wall:.1f} s; " + " | ".join(line for _, line in lines if CLOSING.search(line)),
        flush=True,
    )
    for _, line in lines:
        if line.startswith(("vllm backend:", "hf backend:")):
            print(f"{out.name}: {line}", flush=True)
    return {
        "wall_seconds": wall,
        "loop_tokens_per_s": tps,
        "device_idle": int(m.group(3)) / 100 if m.group(3) else None,
        "first_batch_seconds": float(m.group(4)) if m.group(4) else None,
        "model_load_seconds": float(m.group(5)) if m.group(5) else None,
        "closing_line": next(line for _, line in lines if CLOSING.search(line)),
        # the backends' own lines: where the vllm backend's files waited, its engine steps and reads
        "backend_lines": [line for _, line in lines if line.startswith(("vllm backend:", "hf backend:"))],
        "engine_lines": [f"{t:7.1f} s  {line}" for t, line in lines if ENGINE_TIMING.search(line)][:60],
        "verify_seconds": wall - at,
        "peak_gpu_mib": mem.peak_mib,
        "bytes": dir_bytes(out),
        # what the run left in its caches (a cold row's list is what a first run on a host compiles)
        "cache_mib": cache_sizes(cache),
        **(closing_checks(out) if checks else {}),
    }


def stats_row(
    stats: dict, wall: float, lines: list[tuple[float, str]], mem: GpuMemory, out: Path, cache: Path
):
    """``run_ours``' figures of a run that printed its stats (``--json-stats``): its loop from them, and the
    GPU's busy share over the loop (its start is the process's age then; the timer started with it)."""
    backend_lines = [line for _, line in lines if line.startswith(("vllm backend:", "hf backend:"))]
    print(f"{out.name}: {wall:.1f} s; {stats['tokens_per_s']:,.0f} tok/s", flush=True)
    for line in backend_lines:
        print(f"{out.name}: {line}", flush=True)
    startup = stats.get("startup") or {}
    start = startup.get("loop_start_seconds")
    return {
        "wall_seconds": wall,
        "loop_tokens_per_s": stats["tokens_per_s"],
        "loop_seconds": stats["seconds"],
        "device_idle": stats.get("device_idle_fraction"),
        "first_batch_seconds": start,
        "model_load_seconds": startup.get("model_load_seconds"),
        "gpu_busy_share": None if start is None else mem.busy_share(start, start + stats["seconds"]),
        "stats": stats,
        "backend_lines": backend_lines,
        "engine_lines": [f"{t:7.1f} s  {line}" for t, line in lines if ENGINE_TIMING.search(line)][:60],
        "peak_gpu_mib": mem.peak_mib,
        "bytes": dir_bytes(out),
        "cache_mib": cache_sizes(cache),
    }


MIB = 2**20


def cache_sizes(cache: Path) -> dict[str, float]:
    """MiB under each top-level folder of a row's cache (two levels down for ``home``: ~/.cache/NAME)."""
    if not cache.is_dir():
        return {}
    folders = [p for p in cache.iterdir() if p.is_dir() and p.name != "home"]
    folders += [p for p in (cache / "home").glob("*/*") if p.is_dir()]
    return {
        str(p.relative_to(cache)): round(sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / MIB, 1)
        for p in sorted(folders)
    }


def closing_checks(out: Path) -> dict:
    """Which closing check the run used and its own seconds (its summary.json), then each closing check run
    again on the set, timed: the record check against the full read (both must pass)."""
    from contract.summary import CLOSING_CHECKS
    from pipeline.verify import VerifyConfig, verify

    stats = (
        json.loads((out / "summary.json").read_text())["stats"] if (out / "summary.json").is_file() else {}
    )
    seconds = {}
    for mode in CLOSING_CHECKS:
        t0 = time.perf_counter()
        summary = verify(VerifyConfig(path=out, write_summary=False, closing_check=mode))
        seconds[mode] = time.perf_counter() - t0
        if not summary.ok:
            raise SystemExit(f"the {mode} closing check failed on {out}: {summary.first_failure_line()}")
        if summary.stats["closing_check"] != mode:
            raise SystemExit(f"the {mode} closing check fell back: {summary.stats['closing_check_note']}")
    return {
        "closing_check": stats.get("closing_check"),
        "run_closing_check_seconds": stats.get("closing_check_seconds"),
        "closing_check_seconds": seconds,
        "facts_log_rms_drift": facts_drift(out),
    }


def facts_drift(out: Path, n: int = 8) -> float | None:
    """The largest difference between the log RMS the writer recorded (on a GPU: from the device's figures)
    and the one computed from the file as read back, over the first ``n`` files; exits when they disagree
    beyond float32 rounding or on a non-finite count. None for a set without a version 2 record."""
    from pipeline.ondisk import integrity
    from pipeline.ondisk import formats

    record, worst = formats.read_checksums(out), 0.0
    names = [name for name in sorted(record) if name.startswith("data_")][:n]
    if not names or not all(integrity.has_facts(record[name]) for name in names):
        return None
    for name in names:
        s = formats.read_sample(out / name)
        mine, kept = (
            integrity.written_facts(s["input_ids"], s["hidden_states"], s["loss_mask"]),
            record[name].facts,
        )
        pairs = list(zip(mine["log_rms"] or [], kept["log_rms"] or [], strict=True))
        if (
            mine["nonfinite"] != kept["nonfinite"]
            or (mine["log_rms"] is None) != (kept["log_rms"] is None)
            or any((a is None) != (b is None) for a, b in pairs)
        ):
            raise SystemExit(f"{out / name}: recorded facts {kept} differ from the file's {mine}")
        worst = max([worst, *(abs(a - b) for a, b in pairs if a is not None)])
    if worst > 1e-4:
        raise SystemExit(f"{out}: recorded log RMS off the file's by {worst:.2e} (float32 rounding is ~1e-7)")
    return worst


def run_naive(prepared: Path, model: Path, out: Path) -> dict:
    with GpuMemory() as mem:
        wall, lines = timed_process(
            [
                sys.executable,
                "-m",
                "bench.naive_extract",
                "--prepared",
                str(prepared),
                "--model",
                str(model),
                "--out",
                str(out),
            ]
        )
    stats = json.loads(lines[-1][1])
    return {
        "wall_seconds": wall,
        "loop_tokens_per_s": stats["tokens_per_s"],
        "loop_seconds": stats["seconds"],
        "peak_gpu_mib": mem.peak_mib,
        "bytes": dir_bytes(out),
    }


@click.command()
@click.option(
    "--shapes",
    default="llama-1b,llama-8b",
    show_default=True,
    help="bench/gpu_models.py's dense SHAPES and DeepSeek-V3-layout MOE_SHAPES (dsv3-tiny, dsv3-9b).",
)
@click.option(
    "--samples",
    "counts",
    default="256,128",
    show_default=True,
    help="Conversations per shape, in --shapes order.",
)
@click.option("--seq-length", type=int, default=2048, show_default=True)
@click.option(
    "--workdir", type=click.Path(path_type=Path), default=Path("/dev/shm/e2e-bench"), show_default=True
)
@click.option(
    "--extract-args", default="", help="Extra flags for pipeline extract (default: none, its defaults)."
)
@click.option(
    "--also",
    multiple=True,
    help="NAME[@CACHE]:FLAGS - another `pipeline extract` row on the same set with FLAGS instead of "
    "--extract-args (e.g. 'hf:--backend hf'); VAR=VALUE tokens among the FLAGS go to the row's "
    "environment instead (e.g. 'files:VLLM_ENABLE_V1_MULTIPROCESSING=1 --backend vllm'); @CACHE reuses the "
    "compile caches of the row named CACHE (a warm start), else the row starts with empty caches.",
)
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
@click.option(
    "--baseline",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Another commit's source tree (git archive REV pipeline contract | tar -x -C DIR): its "
    "`pipeline extract` also runs on each set, right after ours, as the 'baseline' row.",
)
@click.option(
    "--naive/--no-naive",
    default=True,
    show_default=True,
    help="Also run the naive script on each set (the whole-process ratio and the fp32 bound need it).",
)
@click.option(
    "--stacks",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Sample every extract row's stacks (bench/stacks.py) into DIR/ROW-SHAPE.json.gz: where its start "
    "and loop go. Sampled rows pay a little GIL time for it.",
)
def main(
    shapes: str,
    counts: str,
    seq_length: int,
    workdir: Path,
    extract_args: str,
    json_out: Path | None,
    baseline: Path | None,
    also: tuple[str, ...],
    naive: bool,
    stacks: Path | None,
) -> None:
    rows = [parse_also(a) for a in also]
    if stacks is not None:
        stacks.mkdir(parents=True, exist_ok=True)

    def sampled(row: str, shape: str) -> list[str] | None:
        if stacks is None:
            return None
        return ["-m", "bench.stacks", "record", "--out", str(stacks / f"{row}-{shape}.json.gz"), "--"]

    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    gpu = torch.cuda.is_available()
    results: dict = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "extract_args": extract_args,
        "shapes": {},
    }
    failures = []
    for shape, n in zip(shapes.split(","), [int(c) for c in counts.split(",")], strict=True):
        t0 = time.perf_counter()
        model = build_model(shape, "cuda" if gpu else "cpu")
        model_dir = save_model(model, workdir / f"model-{shape}")
        vocab, L = model.config.vocab_size, model.config.num_hidden_layers
        del model
        if gpu:
            torch.cuda.empty_cache()
        built = time.perf_counter() - t0
        prepared = workdir / f"prepared-{shape}"
        make_prepared(prepared, n, seq_length, vocab)
        from pipeline.ondisk import formats

        lengths = [int(t) for t in formats.read_prepared(prepared)[0].lengths()]
        roof = model_shape(model_dir)
        ours = run_ours(
            prepared,
            model_dir,
            workdir / f"ours-{shape}",
            extract_args.split(),
            workdir / f"cache-ours-{shape}",
            wrapper=sampled("ours", shape),
        )
        runs = {"ours": ours}
        keep_compared(workdir / f"ours-{shape}")
        if baseline is not None:
            runs["baseline"] = run_ours(
                prepared,
                model_dir,
                workdir / f"baseline-{shape}",
                extract_args.split(),
                workdir / f"cache-base-{shape}",
                baseline,
            )
            # only ours and the naive run are compared file by file: the baseline's set goes at once, so
            # the disk holds two sets at a time, not three
            shutil.rmtree(workdir / f"baseline-{shape}")
        for name, cache_of, flags, row_env in rows:
            runs[name] = run_ours(
                prepared,
                model_dir,
                workdir / f"{name}-{shape}",
                flags,
                workdir / f"cache-{cache_of}-{shape}",
                row_env=row_env,
                wrapper=sampled(name, shape),
            )
            keep_compared(workdir / f"{name}-{shape}")
        if naive:
            runs["naive"] = run_naive(prepared, model_dir, workdir / f"naive-{shape}")
        for r in runs.values():
            loop = sum(lengths) / r["loop_tokens_per_s"]
            r.update(roofline=roof.roofline_fraction(lengths, loop), write_gb_s=r["bytes"] / loop / 1e9)
        compared = {who: workdir / f"{who}-{shape}" for who in ("ours", *(name for name, *_ in rows))}
        if naive:
            compared["naive"] = workdir / f"naive-{shape}"
            worst = agreement(compared["naive"], compared["ours"], min(COMPARED, n), [2, L // 2, L - 3])
            versus_naive = {
                "whole_process_speedup": runs["naive"]["wall_seconds"] / ours["wall_seconds"],
                "loop_speedup": ours["loop_tokens_per_s"] / runs["naive"]["loop_tokens_per_s"],
                "max_rel_err_vs_naive": worst,
            }
        else:
            versus_naive = {}
        errors = accuracy(shape, model_dir, prepared, compared)
        # ours may be no less exact than the naive bf16 script, layer by layer (a slack of a quarter
        # plus 5e-3)
        for who in [w for w in compared if w != "naive"] if naive else []:
            if any(o > 1.25 * b + 5e-3 for o, b in zip(errors[who], errors["naive"], strict=True)):
                failures.append(f"{shape}: {who} is further from fp32 than naive: {errors}")
        if gpu:
            torch.cuda.empty_cache()
        results["shapes"][shape] = {
            "samples": n,
            "tokens": sum(lengths),
            "build_seconds": built,
            "decoder_params": roof.decoder_params,
            "active_decoder_params": round(roof.active_params),
            **runs,
            **versus_naive,
            "rel_err_vs_fp32_per_layer": errors,
        }
        print(json.dumps({shape: results["shapes"][shape]}, indent=1), flush=True)
        for path in compared.values():
            shutil.rmtree(path)
    print("\n| shape | run | whole process s | loop tok/s | decoder roofline | peak GPU MiB | write GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for shape, r in results["shapes"].items():
        for who in ("ours", "baseline", *(name for name, *_ in rows), "naive"):
            if who not in r:
                continue
            x = r[who]
            print(
                f"| {shape} | {who} | {x['wall_seconds']:.1f} | {x['loop_tokens_per_s']:,.0f} | "
                f"{x['roofline']:.1%} | {x['peak_gpu_mib']} | {x['write_gb_s']:.2f} |"
            )
        if "naive" in r:
            print(
                f"| {shape} | ours vs naive | {r['whole_process_speedup']:.2f}x | "
                f"{r['loop_speedup']:.2f}x | | | |"
            )
        if "baseline" in r:
            print(
                f"| {shape} | ours vs baseline | "
                f"{r['baseline']['wall_seconds'] / r['ours']['wall_seconds']:.2f}x | "
                f"{r['ours']['loop_tokens_per_s'] / r['baseline']['loop_tokens_per_s']:.2f}x | | | |"
            )
    print("\n| shape | closing check of the run | its seconds | record check s | full read s |")
    print("|---|---|---:|---:|---:|")
    for shape, r in results["shapes"].items():
        for who in ("ours", "baseline", *(name for name, *_ in rows)):
            if who in r:
                x = r[who]
                print(
                    f"| {shape} {who} | {x['closing_check']} | {x['run_closing_check_seconds']} | "
                    f"{x['closing_check_seconds']['record']:.2f} | {x['closing_check_seconds']['full']:.2f} |"
                )
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(results, indent=2) + "\n")
    if failures:
        raise SystemExit("; ".join(failures))


ENV_TOKEN = re.compile(r"[A-Z][A-Z0-9_]*=\S*")


def parse_also(spec: str) -> tuple[str, str, list[str], dict[str, str]]:
    """``NAME[@CACHE]:FLAGS`` as (name, the row whose caches it uses, flags, environment): the ``VAR=VALUE``
    tokens of FLAGS are the row's environment."""
    head, sep, tokens = spec.partition(":")
    name, _, cache_of = head.partition("@")
    if (
        not sep
        or not name
        or not re.fullmatch(r"[A-Za-z0-9_-]+", name)
        or name in ("ours", "naive", "baseline")
    ):
        raise click.BadParameter(
            f"{spec!r}: expected NAME[@CACHE]:FLAGS with a new row name", param_hint="--also"
        )
    flags = [t for t in tokens.split() if not ENV_TOKEN.fullmatch(t)]
    env = dict(t.split("=", 1) for t in tokens.split() if ENV_TOKEN.fullmatch(t))
    return name, cache_of or name, flags, env


if __name__ == "__main__":
    main()
