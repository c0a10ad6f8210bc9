"""PNG plots of a train run: the loss curve and the per-position acceptance (matplotlib, Agg backend).

Owns the figures only; it reads metrics.jsonl and eval.json written by pipeline/train/stage.py and
pipeline/train/evaluate.py and computes nothing beyond what it draws.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.ondisk.atomic import atomic_path

LOSS_PNG = "loss.png"
ACCEPTANCE_PNG = "acceptance.png"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, target: Path) -> Path:
    with atomic_path(target) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    return target


def loss_curve(rows: list[dict], target: Path) -> Path:
    """Training loss per step (total and per TTT step) and validation loss per epoch."""
    plt = _pyplot()
    train = [r for r in rows if "train" in r]
    val = [r for r in rows if "val" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        steps = [r["step"] for r in train]
        ax.plot(
            steps, [r["train"]["loss"] for r in train], label="train loss (sum over TTT steps)", color="black"
        )
        ttt = sorted(int(k.split("_")[1]) for k in train[0]["train"] if k.startswith("loss_"))
        for j in ttt:
            ax.plot(
                steps,
                [r["train"][f"loss_{j}"] for r in train],
                label=f"train loss, TTT step {j}",
                alpha=0.5,
                linewidth=0.8,
            )
    if val:
        ax.plot(
            [r["step"] for r in val],
            [r["val"]["loss_epoch"] for r in val],
            "o-",
            label="held-out loss (per epoch)",
            color="tab:red",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("KL loss")
    ax.set_yscale("log")
    ax.set_title("EAGLE-3 draft training")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    out = _save(fig, target)
    plt.close(fig)
    return out


def acceptance_bars(ev: dict, target: Path) -> Path:
    """Per-position acceptance of the trained draft and of each baseline."""
    plt = _pyplot()
    series = {"trained draft": ev["draft"], **{f"baseline: {n}": r for n, r in ev["baselines"].items()}}
    k = int(ev["k"])
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(7, 4))
    for n, (name, r) in enumerate(series.items()):
        xs = [j + n * width for j in range(k)]
        ax.bar(
            xs,
            r["per_position"],
            width=width,
            label=f"{name} (acceptance length {r['acceptance_length']:.2f})",
        )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(k)], [f"token {j + 1}" for j in range(k)])
    ax.set_ylabel("share of positions with tokens 1..j accepted")
    ax.set_ylim(0, 1)
    ax.set_title(f"offline acceptance on {ev['samples']} held-out samples ({ev['positions']} positions)")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    out = _save(fig, target)
    plt.close(fig)
    return out


def draw_all(out: Path) -> list[Path]:
    """Draw every plot whose inputs exist in a train output dir; return the files written."""
    from pipeline.train.files import EVAL, METRICS, read_metrics

    out = Path(out)
    written = []
    rows = read_metrics(out / METRICS)
    if rows:
        written.append(loss_curve(rows, out / LOSS_PNG))
    if (out / EVAL).is_file():
        written.append(acceptance_bars(json.loads((out / EVAL).read_text()), out / ACCEPTANCE_PNG))
    return written
