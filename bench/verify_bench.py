"""Benchmark: `pipeline verify` over a hidden-states set vs. dd's sequential read vs. a naive torch.load loop.

Builds (once per run) a prepared set and matching ``data_{i}.pt`` files of random bf16 states, then in one
process, on the same filesystem: dd writes and reads one file of the same total size; the naive loop
(torch.load of every file, one after another, ``isfinite`` on every state); and ``pipeline verify``'s
hidden-states checks with several reader counts and both data-file loaders. Each figure is the best of
--repeat runs, measured in turns so that every variant sees the same page-cache state. Needs no GPU.

    python -m bench.verify_bench --dir /dev/shm/vb --gb 4 --hidden 2048     # tmpfs
    python -m bench.verify_bench --dir /tmp/vb --gb 4 --hidden 2048         # the disk (page-cached reads)
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import numpy as np
import torch

from bench.extract_bench import make_prepared
from bench.scaling_bench import dd, naive_verify


def make_set(root: Path, gb: float, hidden: int, seq_length: int, layers: int = 4) -> Path:
    """A prepared dir and a hidden-states dir of about ``gb`` GB whose files pass every per-file check."""
    from pipeline.ondisk import formats

    per_token = layers * hidden * 2
    n = max(8, int(gb * 1e9 / per_token / (0.75 * seq_length)))
    make_prepared(root / "prepared", n, seq_length, vocab=32000)
    samples, _ = formats.read_prepared(root / "prepared")
    out = root / "states"
    out.mkdir()
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(seq_length, hidden, generator=gen).to(torch.bfloat16)

    def write(i: int) -> None:
        t = samples.length(i)
        states = [noise[:t].roll(j + i, 0).clone() for j in range(layers)]
        formats.write_sample(
            formats.data_file(out, i),
            torch.from_numpy(samples.ids(i).astype(np.int64)),
            states,
            torch.from_numpy(samples.mask(i).astype(np.int64)),
        )

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, range(n)))
    formats.write_data_config(
        out,
        formats.DataConfig(
            model="bench",
            layer_ids=list(range(layers)),
            num_layers=layers,
            hidden_size=hidden,
            dtype="bfloat16",
            num_samples=n,
            seq_length=seq_length,
            prepared=str((root / "prepared").resolve()),
            backend="hf",
        ),
    )
    formats.write_sample_lengths(out, {i: samples.length(i) for i in range(n)})
    return out


LOADERS = ("buffer", "weights_only")


def timed_verify(states: Path, workers: int, loader: str) -> float:
    """One ``verify`` of the set, reading data files into reused buffers (verify's own path) or, as before
    it, with ``torch.load(weights_only=True, mmap=True)`` (forced the way an operator would: the
    environment, which turns the buffer path off)."""
    from pipeline.verify import VerifyConfig, verify

    before = os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
    if loader == "weights_only":
        os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        t0 = time.perf_counter()
        summary = verify(VerifyConfig(path=states, workers=workers, write_summary=False))
        seconds = time.perf_counter() - t0
    finally:
        os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        if before is not None:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before
    if not summary.ok:
        raise SystemExit(
            "verify failed on the benchmark set: "
            f"{[c.detail for c in summary.checks if c.status == 'fail'][:3]}"
        )
    return seconds


@click.command()
@click.option(
    "--dir", "root", type=click.Path(path_type=Path), default=Path("/tmp/verify-bench"), show_default=True
)
@click.option("--gb", type=float, default=1.0, show_default=True, help="Size of the hidden-states set.")
@click.option("--hidden", type=int, default=1024, show_default=True)
@click.option("--seq-length", type=int, default=2048, show_default=True)
@click.option(
    "--workers",
    default="0",
    show_default=True,
    help="Comma-separated reader counts to compare (0 = verify's default).",
)
@click.option(
    "--loaders",
    default="buffer,weights_only",
    show_default=True,
    help="Data-file loaders to compare: buffer (verify's own) and/or weights_only (torch.load as before it).",
)
@click.option("--repeat", type=int, default=2, show_default=True)
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
def main(
    root: Path,
    gb: float,
    hidden: int,
    seq_length: int,
    workers: str,
    loaders: str,
    repeat: int,
    json_out: Path | None,
) -> None:
    unknown = [x for x in loaders.split(",") if x not in LOADERS]
    if unknown:
        raise click.BadParameter(
            f"unknown loader {unknown[0]!r}: use {', '.join(LOADERS)}", param_hint="--loaders"
        )
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    states = make_set(root, gb, hidden, seq_length)
    files = sorted(states.glob("data_*.pt"))
    nbytes = sum(f.stat().st_size for f in files)
    results: dict = {"files": len(files), "bytes": nbytes, "cpus": os.cpu_count(), "torch": torch.__version__}
    results.update(dd(root / "dd.bin", nbytes))
    timings: dict[str, list[float]] = {}
    for _ in range(repeat):
        timings.setdefault("naive", []).append(naive_verify(states))
        for w in [int(x) for x in workers.split(",")]:
            for loader in loaders.split(","):
                timings.setdefault(f"verify_{loader}_workers_{w}", []).append(timed_verify(states, w, loader))
    best = {k: min(v) for k, v in timings.items()}
    results["gb_s"] = {k: nbytes / s / 1e9 for k, s in best.items()}
    results["vs_dd_read"] = {k: g / results["dd_read_gb_s"] for k, g in results["gb_s"].items()}
    results["vs_naive"] = {k: best["naive"] / s for k, s in best.items()}
    print(json.dumps(results, indent=2))
    if json_out:
        json_out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
