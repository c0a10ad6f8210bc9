"""Benchmark: data-parallel extraction, 1 -> N GPUs of one host, and write/read bandwidth vs dd.

For each N in --sweep (repeats allowed: "1,2,1,2"), runs `pipeline extract --data-parallel N` as a fresh
process on the same prepared set into a fresh directory under --out-root and reports tokens/s (loop time:
the slowest worker's, model load excluded; and wall time including process start and model load). Then times,
on the same filesystem and in the same run: `dd` writing and reading a file of the same size,
`pipeline verify` over the written set, and the naive verification loop (torch.load of every file, one after
another).

    python bench/scaling_bench.py --preset llama-1b --sweep 1,2 --out-root /dev/shm/sb
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click
import torch

from bench.extract_bench import PRESETS, make_prepared
from pipeline.extract.writer import WRITER_THREADS


def dd(path: Path, size_bytes: int) -> dict:
    count = max(1, size_bytes // (16 << 20))
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "conv=fdatasync"],
        check=True,
        capture_output=True,
    )
    w = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    r = time.perf_counter() - t0
    path.unlink()
    nbytes = count * (16 << 20)
    return {"dd_write_gb_s": nbytes / w / 1e9, "dd_read_gb_s": nbytes / r / 1e9}


def dd_parallel_write(directory: Path, size_bytes: int, writers: int = 8) -> float:
    """GB/s of ``writers`` dd processes writing size/writers each at once (with fdatasync): the filesystem's
    write ceiling for a loop that writes from several threads, which one dd stream does not show."""
    count = max(1, size_bytes // writers // (16 << 20))
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                "dd",
                "if=/dev/zero",
                f"of={directory / f'dd{k}.bin'}",
                "bs=16M",
                f"count={count}",
                "conv=fdatasync",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for k in range(writers)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("parallel dd failed")
    elapsed = time.perf_counter() - t0
    for k in range(writers):
        (directory / f"dd{k}.bin").unlink()
    return writers * count * (16 << 20) / elapsed / 1e9


def naive_verify(directory: Path) -> float:
    files = sorted(directory.glob("data_*.pt"))
    t0 = time.perf_counter()
    for f in files:
        d = torch.load(f, weights_only=True)
        for h in d["hidden_states"]:
            torch.isfinite(h).all()
    return time.perf_counter() - t0


def expected_set_bytes(prepared: Path, model_dir: Path, layers: int = 4) -> int:
    """The size of the hidden states a run writes: every token's states of ``layers`` layers in extract's
    default dtype (bf16 on a GPU, fp32 on the CPU); the files' own overhead, a few KB each, left out."""
    from pipeline.ondisk import formats

    _, meta = formats.read_prepared(prepared)
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    return meta.num_tokens * hidden * layers * (2 if torch.cuda.is_available() else 4)


@click.command()
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="tiny", show_default=True)
@click.option("--sweep", default="1,2", show_default=True, help="Data-parallel sizes to run.")
@click.option("--samples", type=int, default=None)
@click.option(
    "--out-root", type=click.Path(path_type=Path), default=Path("/tmp/scaling-bench"), show_default=True
)
@click.option("--max-batch-tokens", type=int, default=32768, show_default=True)
@click.option("--writer-threads", type=int, default=WRITER_THREADS, show_default=True)
@click.option(
    "--verify/--no-verify",
    "with_verify",
    default=True,
    show_default=True,
    help="Also time pipeline verify and the naive loop on the last set "
    "(bench/verify_bench.py does it alone).",
)
@click.option(
    "--warm-up/--no-warm-up",
    default=True,
    show_default=True,
    help="First write (dd) and delete a file as large as one set under --out-root, so that the first run "
    "does not pay alone for memory or blocks the filesystem touches for the first time.",
)
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def main(
    preset: str,
    sweep: str,
    samples: int | None,
    out_root: Path,
    max_batch_tokens: int,
    writer_threads: int,
    with_verify: bool,
    warm_up: bool,
    json_out: Path | None,
) -> None:
    from pipeline.demo.tiny import build_tiny_model
    from pipeline.verify import VerifyConfig, verify

    overrides, n, seq_length, _ = PRESETS[preset]
    n = samples or n
    shutil.rmtree(out_root, ignore_errors=True)
    out_root.mkdir(parents=True)
    model_dir = build_tiny_model("llama", out_root / "model", **overrides)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    make_prepared(out_root / "prepared", n, seq_length, vocab)
    results: dict = {
        "preset": preset,
        "samples": n,
        "writer_threads": writer_threads,
        "seq_length": seq_length,
        "gpus": torch.cuda.device_count(),
        "runs": [],
    }
    if warm_up:
        # the lent GPU VMs grow their memory as it is first used (~3 s per 8 GiB): on tmpfs that would land
        # on the first run only; the same dd as the baseline below, so its figures come for free
        set_bytes = expected_set_bytes(out_root / "prepared", model_dir)
        results["warm_up"] = {"bytes": set_bytes, **dd(out_root / "warm-up.bin", set_bytes)}
        print(json.dumps({"warm_up": results["warm_up"]}), flush=True)
    sizes = [
        int(x) for x in sweep.split(",")
    ]  # repeats allowed ("1,2,1,2"): runs alternate, so drift hits both
    for k, dp in enumerate(sizes):
        out = out_root / f"run{k}-dp{dp}"
        t0 = time.perf_counter()
        # each size runs as users run it, a fresh `pipeline extract` process: the same start for 1 and N
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline",
                "extract",
                "--prepared",
                str(out_root / "prepared"),
                "--model",
                str(model_dir),
                "--out",
                str(out),
                "--data-parallel",
                str(dp),
                "--max-batch-tokens",
                str(max_batch_tokens),
                "--writer-threads",
                str(writer_threads),
                "--no-verify",
                "--no-progress",
                "--json-stats",
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(f"extract --data-parallel {dp} failed: {proc.stderr.strip().splitlines()[-1:]}")
        stats = json.loads(proc.stdout.strip().splitlines()[-1])
        wall = time.perf_counter() - t0
        workers = stats.get("workers") or [stats]
        loop = max(w["seconds"] for w in workers)
        results["runs"].append(
            {
                "data_parallel": dp,
                "tokens": stats["tokens"],
                "loop_tokens_per_s": stats["tokens"] / loop,
                "wall_tokens_per_s": stats["tokens"] / wall,
                "bytes": stats["bytes"],
                "write_gb_s": stats["bytes"] / loop / 1e9,
                "device_idle_fraction": stats.get("device_idle_fraction"),
                "wall_seconds": wall,
                "startup": stats.get("startup"),
                "workers": [
                    {
                        k: w.get(k)
                        for k in (
                            "tokens",
                            "seconds",
                            "capture_seconds",
                            "writer_wait_seconds",
                            "device_busy_seconds",
                            "device_idle_fraction",
                            "startup",
                        )
                    }
                    for w in workers
                ],
            }
        )
        print(json.dumps(results["runs"][-1]), flush=True)
        last = out
        if k != len(sizes) - 1:
            shutil.rmtree(out)
    # scaling: each run against the mean of the smallest size's runs, and each run against the one before it
    # when that one ran the smallest size (the pairs of a "1,2,1,2" sweep)
    smallest = min(sizes)
    base = sum(
        r["loop_tokens_per_s"] for r in results["runs"] if r["data_parallel"] == smallest
    ) / sizes.count(smallest)
    for r in results["runs"]:
        r["scaling_vs_min"] = r["loop_tokens_per_s"] / base
    results["pair_scaling"] = [
        (b["data_parallel"], b["loop_tokens_per_s"] / a["loop_tokens_per_s"])
        for a, b in zip(results["runs"], results["runs"][1:])
        if a["data_parallel"] == smallest < b["data_parallel"]
    ]
    print(
        json.dumps(
            {
                "scaling": [(r["data_parallel"], round(r["scaling_vs_min"], 3)) for r in results["runs"]],
                "pairs": [(dp, round(x, 3)) for dp, x in results["pair_scaling"]],
            }
        ),
        flush=True,
    )
    total_bytes = sum(p.stat().st_size for p in last.glob("data_*.pt"))
    if not with_verify:  # the set is not read again: free its space before dd writes as much
        shutil.rmtree(last)
    results.update(dd(out_root / "dd.bin", total_bytes))
    results["dd_parallel_write_gb_s"] = dd_parallel_write(out_root, total_bytes)
    if with_verify:
        t0 = time.perf_counter()
        summary = verify(VerifyConfig(path=last, write_summary=False))
        ours_s = time.perf_counter() - t0
        naive_s = naive_verify(last)
        results.update(
            verify_ok=summary.ok,
            verify_bytes=total_bytes,
            verify_gb_s=total_bytes / ours_s / 1e9,
            naive_verify_gb_s=total_bytes / naive_s / 1e9,
            verify_vs_naive=naive_s / ours_s,
        )
        results["verify_vs_dd_read"] = results["verify_gb_s"] / results["dd_read_gb_s"]
    print(json.dumps(results, indent=2))
    if json_out:
        json_out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
