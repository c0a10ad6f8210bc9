"""Benchmark: how a produced run's loader workers start, ``spawn`` (each worker a fresh interpreter that
imports speculators, transformers and torch's inductor itself) against the fork server started at setup
(pipeline/train/data.py ``READER_START``: the imports done once, beside the trainer's setup; each worker
forked from it ready), side by side in one run.

Each row is a fresh ``pipeline train`` process (in process here, through ``pipeline.train.stage.run``) of the
same draft on the same set, ``--states-mode online|hybrid`` with the hf producer, within the train bench's
budget (bench/states_modes.py ``budget_between``), the start method set in that process only. Rows go in
turns (mode by mode, the two starts one after the other, ``--repeat`` rounds), so that a noisy machine
weighs on both. Reported per row: the whole stage, epoch 0 (which waits for the train loader's workers),
the validations (the first waits for the validation loader's), the rest of the training phase outside
epochs, and the draft's acceptance: both starts must train the same draft, or the bench exits non-zero.

    python -m bench.reader_start_bench --workdir /tmp/reader-start --conversations 240 --repeat 2 \\
        --json-out runs/bench-reader-start.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import click

from bench.timing import timed

REPO = Path(__file__).resolve().parent.parent
STARTS = ("spawn", "forkserver")


def row(workdir: Path, mode: str, start: str, workers: int, epochs: int) -> dict:
    """One produced run in this process with its loader workers started by ``start``; its figures."""
    import dataclasses
    import time

    import pipeline.train.data as data
    from bench.states_modes import offline_budget
    from pipeline.train.cli import quiet_libraries
    from pipeline.train.stage import TrainConfig, run

    quiet_libraries()
    data.READER_START = start  # read where the loaders are made (stage.make_loader, ProducedDataset)
    cfg = TrainConfig(
        data=workdir / "hidden_states",
        verifier=workdir / "verifier",
        out=workdir / f"train-{mode}",
        model=workdir / "model",
        prepared=workdir / "prepared",
        eval_max_samples=32,
        epochs=epochs,
        max_len=1024,
        lr=1e-3,
        num_workers=workers,
        overwrite=True,
    )
    _, budget = offline_budget(cfg)
    cfg = dataclasses.replace(
        cfg, states_mode=mode, states_backend="hf", states_budget=str(budget), data=workdir / f"states-{mode}"
    )
    t0 = time.perf_counter()
    summary = run(cfg, log=lambda m: None)
    wall = time.perf_counter() - t0
    train = summary["train"]
    phases = train["phase_seconds"]
    epochs_s = train["epoch_seconds"]
    return {
        "mode": mode,
        "start": start,
        "stage_seconds": round(wall, 2),
        "epoch0_seconds": epochs_s[0],
        "later_epochs_seconds": round(sum(epochs_s[1:]), 3),
        "validation_seconds": phases["training_validation"],
        "outside_epochs_seconds": round(
            phases["training"]
            - sum(epochs_s)
            - phases["training_validation"]
            - phases["training_checkpoints"],
            3,
        ),
        "acceptance": summary["eval"]["draft"]["acceptance_length"],
    }


def table(rows: list[dict]) -> tuple[list[str], list[str]]:
    """The medians per mode and start, the ratio of the stage's seconds, and the failures (a start whose
    draft differs from the other's)."""
    keys = (
        "stage_seconds",
        "epoch0_seconds",
        "later_epochs_seconds",
        "validation_seconds",
        "outside_epochs_seconds",
    )
    lines = [
        "| mode | start | runs | stage s | epoch 0 s | later epochs s | validation s | outside epochs s "
        "| acceptance |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    failures = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        med = {}
        for start in STARTS:
            mine = [r for r in rows if r["mode"] == mode and r["start"] == start]
            med[start] = {k: statistics.median(r[k] for r in mine) for k in keys}
            accept = sorted({r["acceptance"] for r in mine})
            cells = " | ".join(f"{med[start][k]:.1f}" for k in keys)
            lines.append(
                f"| {mode} | {start} | {len(mine)} | {cells} | {', '.join(f'{a:.4f}' for a in accept)} |"
            )
        got = {r["acceptance"] for r in rows if r["mode"] == mode}
        if len(got) != 1:
            failures.append(f"{mode}: the two starts trained different drafts (acceptance {sorted(got)})")
        ratio = med["spawn"]["stage_seconds"] / med["forkserver"]["stage_seconds"]
        lines.append(f"| {mode} | spawn / forkserver | | **{ratio:.2f}x** | | | | | |")
    return lines, failures


@click.command()
@click.option(
    "--workdir", type=click.Path(path_type=Path), default=Path("/tmp/reader-start"), show_default=True
)
@click.option("--conversations", type=int, default=240, show_default=True)
@click.option("--epochs", type=int, default=3, show_default=True)
@click.option("--workers", type=int, default=4, show_default=True, help="Each loader's worker processes.")
@click.option("--modes", default="online,hybrid", show_default=True)
@click.option("--repeat", type=int, default=2, show_default=True, help="Rounds of every (mode, start) row.")
@click.option("--json-out", type=click.Path(path_type=Path), default=None)
@click.option("--row", "row_args", nargs=2, default=None, hidden=True, help="MODE START: one row (a child).")
def main(workdir, conversations, epochs, workers, modes, repeat, json_out, row_args) -> None:
    """Loader workers started by spawn against by the fork server, in produced training runs, in turns."""
    if row_args:
        print(json.dumps(row(workdir, *row_args, workers=workers, epochs=epochs)))
        return
    from bench.train_bench import build_random_set

    build_random_set(workdir, "tiny", conversations)
    rows = []
    for _ in range(repeat):
        for mode in modes.split(","):
            for start in STARTS:
                argv = [sys.executable, "-m", "bench.reader_start_bench", "--workdir", str(workdir)]
                argv += ["--epochs", str(epochs), "--workers", str(workers), "--row", mode, start]
                done = timed(argv, cwd=REPO)
                if done.returncode != 0:
                    raise SystemExit(f"reader_start_bench: the {mode}/{start} row failed:\n{done.tail()}")
                figures = next(line for _, line in reversed(done.lines) if line.startswith('{"mode"'))
                rows.append({**json.loads(figures), "process_seconds": round(done.wall, 2)})
                click.echo(json.dumps(rows[-1]), err=True)
    lines, failures = table(rows)
    click.echo("\n".join(lines))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(
            json.dumps({"conversations": conversations, "workers": workers, "rows": rows}, indent=1)
        )
    if failures:
        raise SystemExit("\n".join(failures))


if __name__ == "__main__":
    main()
