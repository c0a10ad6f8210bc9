"""What the train stage writes into its ``--out``: the names (the layout is in pipeline/train/stage.py's
docstring) and the reading of its per-step metrics. Imported by train, evaluate, plots and the checkpoint
checks, so none of them imports another for a file name."""

from __future__ import annotations

import json
from pathlib import Path

from contract.summary import FILE as SUMMARY

CHECKPOINTS = "checkpoints"
DRAFT = "draft"
VERIFIER_VIEW = "verifier"
TRAIN_CONFIG = "train_config.json"
METRICS = "metrics.jsonl"
EVAL = "eval.json"
__all__ = [
    "CHECKPOINTS",
    "DRAFT",
    "EVAL",
    "METRICS",
    "SUMMARY",
    "TRAIN_CONFIG",
    "VERIFIER_VIEW",
    "last_metrics",
    "read_metrics",
]


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl's records, oldest first ([] before the first step)."""
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def last_metrics(path: Path) -> dict:
    """The last training step's metrics and the last validation record."""
    rows = read_metrics(path)
    train = [r for r in rows if "train" in r]
    val = [r for r in rows if "val" in r]
    return {
        "last_train": train[-1] if train else None,
        "last_val": val[-1] if val else None,
        "steps": len(train),
    }
