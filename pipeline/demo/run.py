"""``make demo``: the whole pipeline on a built-in tiny model, from nothing, in a few minutes on a CPU.

Owns the sequence of stage invocations and their arguments for the demo (every stage runs through its
real command line, ``python -m pipeline ...``, in a subprocess, exactly as an operator would run it) and
``pipeline demo-assets``, which builds the demo's model and conversations (pipeline/demo/tiny.py for the
random kinds, pipeline/demo/learned.py for the learned one).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import click

from pipeline.ondisk.paths import LoopCheckedPath

from contract.stages import STAGES
from pipeline.demo import learned, tiny


def stage(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pipeline", *args]
    click.secho(f"\n$ {shlex.join(['python', '-m', 'pipeline', *args])}", fg="cyan", bold=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    if rc != 0:
        raise SystemExit(f"demo: stage `{args[0]}` failed with exit code {rc}")
    click.secho(f"  ({time.perf_counter() - t0:.1f} s)", dim=True)


def steps(work: Path, kind: str, samples: int, seq_length: int, train: bool) -> list[list[str]]:
    # the host's layout (contract/stages.py): what ops and compose would name each stage's output
    assets = work / "assets"
    prepared, states, verifier, draft = (
        work / STAGES[s].output for s in ("prepare", "extract", "weights", "train")
    )
    model = assets / "model"
    plan = [
        ["demo-assets", "--out", str(assets), "--kind", kind, "--conversations", str(samples)],
        [
            "prepare",
            "--data",
            str(assets / "conversations.jsonl"),
            "--model",
            str(model),
            "--out",
            str(prepared),
            "--seq-length",
            str(seq_length),
            "--draft-vocab-size",
            "1024",
            "--overwrite",
        ],
        [
            "extract",
            "--prepared",
            str(prepared),
            "--model",
            str(model),
            "--out",
            str(states),
            "--overwrite",
            "--no-verify",
        ],
        ["weights", "--model", str(model), "--out", str(verifier), "--overwrite"],
        ["verify", str(prepared)],
        ["verify", str(states), "--verifier", str(verifier), "--model", str(model)],
    ]
    if train:
        # the tiny random target's greedy tokens are spread over its whole vocab: a smaller draft vocab
        # (the real-model default) would leave the draft nothing it can predict
        plan.append(
            [
                "train",
                "--data",
                str(states),
                "--prepared",
                str(prepared),
                "--verifier",
                str(verifier),
                "--model",
                str(model),
                "--out",
                str(draft),
                "--overwrite",
                "--epochs",
                "2",
                "--max-len",
                "1024",
                "--lr",
                "1e-3",
            ]
        )
        plan.append(["verify", str(draft)])
    return plan


@click.command("demo-assets")
@click.option("--out", "out_dir", type=LoopCheckedPath(), required=True, help="Directory to create.")
@click.option(
    "--kind",
    type=click.Choice([*tiny.KINDS, "learned"]),
    default="llama",
    show_default=True,
    help="learned: a Llama trained for --train-seconds on the stdlib's sources (pipeline/demo/learned.py).",
)
@click.option("--conversations", type=int, default=300, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--train-seconds", type=float, default=60.0, show_default=True, help="Training time of --kind learned."
)
def assets_command(out_dir: Path, kind: str, conversations: int, seed: int, train_seconds: float) -> None:
    """Build a tiny model (OUT/model) and conversations (OUT/conversations.jsonl) for it."""
    if kind == "learned":
        learned.build_learned_model(out_dir / "model", seconds=train_seconds, seed=seed)
        learned.write_conversations(out_dir / "conversations.jsonl", conversations, seed)
        click.echo(f"wrote {out_dir / 'model'} and {out_dir / 'conversations.jsonl'}")
        return
    tiny.build_tiny_model(kind, out_dir / "model", seed=seed)
    tiny.write_conversations(out_dir / "conversations.jsonl", conversations, seed)
    click.echo(f"wrote {out_dir / 'model'} and {out_dir / 'conversations.jsonl'}")


@click.command()
@click.option("--workdir", type=LoopCheckedPath(), default=Path("demo"), show_default=True)
@click.option(
    "--kind",
    type=click.Choice(["llama", "deepseek_v3", "learned"]),
    default="llama",
    show_default=True,
    help="learned: a tiny Llama trained for a minute on real text, so the acceptance table means something.",
)
@click.option("--samples", type=int, default=300, show_default=True)
@click.option("--seq-length", type=int, default=256, show_default=True)
@click.option("--train/--no-train", default=True, show_default=True)
def main(workdir: Path, kind: str, samples: int, seq_length: int, train: bool) -> None:
    """prepare -> extract -> weights -> train -> verify on a tiny random (or --kind learned) model."""
    t0 = time.perf_counter()
    for args in steps(workdir, kind, samples, seq_length, train):
        stage(args)
    click.secho(
        f"\ndemo finished in {time.perf_counter() - t0:.0f} s; outputs under {workdir}/",
        fg="green",
        bold=True,
    )
