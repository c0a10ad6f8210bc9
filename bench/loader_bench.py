"""Benchmark: the training loader's host-side cost with fp32 batches against bf16 batches, side by side.

`pipeline train` on a GPU hands the trainer bf16 batches (pipeline/train/stage.py ``states_dtype``); it used
to hand fp32 ones, while speculators' own loader hands bf16. This measures only what that choice changes on
the host: reading ``data_{i}.pt`` (page cache warm), converting and concatenating the captured layers,
packing with speculators' sampler and collate, and pinning (where CUDA is present). The GPU step is not
here: whether the loader bounds a GPU step is the trainer's ``fetch_frac`` on a GPU run.

Writes a synthetic set of the llama-1b preset's shape (hidden 2048, 4 captured layers, stored in bf16 as
extract writes it; bench/verify_bench.py ``make_set``, mixed lengths up to --length) into --workdir, then
alternates the two dtypes --rounds times after one warm-up pass of
each and reports tokens/s per dtype (median of the rounds) and their ratio.

    python -m bench.loader_bench --workdir /tmp/loader-bench --json-out runs/loader_bench.json
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

import click
import torch

from bench.verify_bench import make_set
from pipeline.ondisk import formats


def one_pass(files: list[Path], dtype: torch.dtype, *, max_len: int, hidden: int, workers: int) -> dict:
    """Every batch of one epoch; seconds and tokens."""
    from pipeline.train.data import make_loader

    loader = make_loader(
        files,
        max_len=max_len,
        hidden_size=hidden,
        world_size=1,
        rank=0,
        seed=0,
        workers=workers,
        pin_memory=torch.cuda.is_available(),
        dtype=dtype,
    )
    tokens = 0
    start = time.perf_counter()
    for batch in loader:
        tokens += int(batch["loss_mask"].numel())
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


@click.command()
@click.option(
    "--workdir", type=click.Path(path_type=Path), required=True, help="Where the synthetic set goes."
)
@click.option("--gb", default=1.2, show_default=True, help="Size of the set in GB.")
@click.option("--length", default=2048, show_default=True, help="Longest sample, in tokens.")
@click.option("--hidden", default=2048, show_default=True, help="Hidden size (llama-1b preset: 2048).")
@click.option("--max-len", default=2048, show_default=True, help="Tokens per packed batch.")
@click.option("--workers", default=0, show_default=True, help="DataLoader workers (0: in this process).")
@click.option("--rounds", default=3, show_default=True, help="Alternating measured passes per dtype.")
@click.option("--json-out", type=click.Path(path_type=Path), help="Write the figures here too.")
def main(workdir, gb, length, hidden, max_len, workers, rounds, json_out):
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    states = make_set(workdir, gb, hidden, length)
    files = [formats.data_file(states, i) for i in formats.existing_data_indices(states)]
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    for dtype in dtypes.values():  # warm-up: page cache, imports, allocator
        one_pass(files, dtype, max_len=max_len, hidden=hidden, workers=workers)
    runs: dict[str, list[dict]] = {name: [] for name in dtypes}
    for _ in range(rounds):
        for name, dtype in dtypes.items():
            runs[name].append(one_pass(files, dtype, max_len=max_len, hidden=hidden, workers=workers))
    tokens = {name: {r["tokens"] for r in rs} for name, rs in runs.items()}
    if len(set().union(*tokens.values())) != 1:  # both dtypes must pack the same batches
        raise click.ClickException(f"the passes saw different token counts: {tokens}")
    rates = {name: statistics.median(r["tokens"] / r["seconds"] for r in rs) for name, rs in runs.items()}
    result = {
        "command": shlex.join(["python", "-m", "bench.loader_bench", *sys.argv[1:]]),
        "host": platform.node(),
        "cpus": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "set": {"samples": len(files), "max_length": length, "hidden": hidden, "stored": "bfloat16"},
        "workers": workers,
        "tokens_per_s": rates,
        "bf16_over_fp32": rates["bfloat16"] / rates["float32"],
        "tokens_per_pass": runs["float32"][0]["tokens"],
        "runs": runs,
    }
    click.echo("| batches in | tokens/s (median of %d) |\n|---|---|" % rounds)
    for name, rate in rates.items():
        click.echo(f"| {name} | {rate:,.0f} |")
    click.echo(f"bf16 / fp32: {result['bf16_over_fp32']:.2f}x")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
