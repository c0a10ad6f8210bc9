"""The naive extraction script the benchmarks compare with, as a process of its own.

One conversation at a time, ``output_hidden_states=True`` (every layer kept on the device), the chosen layers
copied to the host and ``torch.save``d per sample: what a widely used one-file dump script does. Prints one
JSON line: its loop's tokens, seconds and tokens/s (the whole process is timed by the caller).

    python -m bench.naive_extract --prepared P --model M --out O [--limit N]
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import torch


@click.command()
@click.option("--prepared", type=click.Path(path_type=Path), required=True)
@click.option("--model", type=click.Path(path_type=Path), required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--limit", type=int, default=None, help="Only the first N samples.")
def main(prepared: Path, model: Path, out: Path, limit: int | None) -> None:
    from bench.extract_bench import naive
    from pipeline.ondisk import formats

    n = len(formats.read_prepared(prepared)[0]) if limit is None else limit
    L = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    gpu = torch.cuda.is_available()
    stats = naive(
        model,
        prepared,
        out,
        n,
        [2, L // 2, L - 3, L - 1],
        "cuda" if gpu else "cpu",
        torch.bfloat16 if gpu else torch.float32,
    )
    click.echo(json.dumps(stats))


if __name__ == "__main__":
    main()
