"""The stage table: for each pipeline stage, what it reads and writes under the host's data root, its
container command, and how ops runs it (GPUs, parallel layout, preflight, verification after it).

The one source of ops' stage plans (ops/stage.py), of compose.yaml's stage services (ops/composefile.py
renders them; tests/ops/test_ops_compose.py checks the committed file against it) and of the folder names
the demo uses (pipeline/demo/run.py), so a host prepared by hand, by compose and by ops has one layout.
"""

from __future__ import annotations

from dataclasses import dataclass

DATA, MODEL, CACHE = "/data", "/model", "/cache"  # where the container sees the data root, model and cache


@dataclass(frozen=True)
class StageSpec:
    """A stage's defaults, paths relative to the data root. The one source of both ops' plans and
    compose.yaml's stage services (ops.composefile renders them from this table)."""

    inputs: tuple[str, ...]  # must exist on the host before the run
    output: str  # the folder the stage writes (and summary.json lands in)
    args: tuple[str, ...]  # `python -m pipeline STAGE ARGS` (container paths)
    verify_after: bool  # run `pipeline verify OUTPUT` after the stage (extract verifies itself)
    uses_model: bool = True
    gpus: bool = True  # the container gets the host's GPUs (docker --gpus, compose device reservation)
    layout: bool = (
        False  # takes the host's parallel layout (ops.layout): --backend, --tensor-parallel-size ...
    )
    # what runs inside the image before anything on the host is stopped (preflight_script):
    # "args": `pipeline check-args` of the exact argv; "model": `pipeline preflight` of the model (config,
    # checkpoint headers, tokenizer, chat template) that checks the argv first; "extract": the full
    # extraction preflight that checks the argv first (one process either way)
    preflight: str = "args"
    # check names that refuse the run ("" = every failed check); others are reported as warnings
    fatal: tuple[str, ...] = ()
    compose_vars: tuple[tuple[str, str, str], ...] = ()  # (argv word, compose variable, its default)


STAGES: dict[str, StageSpec] = {
    "prepare": StageSpec(
        ("conversations.jsonl",),
        "prepared",
        ("--data", f"{DATA}/conversations.jsonl", "--model", MODEL, "--out", f"{DATA}/prepared"),
        False,
        gpus=False,
        preflight="model",
        # prepare reads config, tokenizer and chat template, never the checkpoint
        fatal=("arguments", "model config", "tokenizer", "chat template", "stage preflight"),
        compose_vars=((f"{DATA}/conversations.jsonl", "PREPARE_DATA", f"{DATA}/conversations.jsonl"),),
    ),
    "extract": StageSpec(
        ("prepared",),
        "hidden_states",
        (
            "--prepared",
            f"{DATA}/prepared",
            "--model",
            MODEL,
            "--out",
            f"{DATA}/hidden_states",
            "--no-progress",
        ),
        False,
        layout=True,
        preflight="extract",
    ),
    "weights": StageSpec((), "verifier", ("--model", MODEL, "--out", f"{DATA}/verifier"), True, gpus=False),
    "train": StageSpec(
        ("hidden_states", "verifier", "prepared"),
        "train",
        (
            "--data",
            f"{DATA}/hidden_states",
            "--verifier",
            f"{DATA}/verifier",
            "--prepared",
            f"{DATA}/prepared",
            "--model",
            MODEL,
            "--out",
            f"{DATA}/train",
        ),
        True,
    ),
    "verify": StageSpec(
        ("hidden_states",),
        "hidden_states",
        (f"{DATA}/hidden_states",),
        False,
        uses_model=False,
        compose_vars=((f"{DATA}/hidden_states", "VERIFY_PATH", f"{DATA}/hidden_states"),),
    ),
}


def markdown_table() -> str:
    """The table as docs/ops.md shows it (between its `stages:begin`/`stages:end` markers; a test holds the
    two equal): inputs, output, GPUs, the container command and what ops runs after it."""
    rows = [
        "| stage | inputs under data root | output | GPUs | container command | after it |",
        "|---|---|---|---|---|---|",
    ]
    for name, spec in STAGES.items():
        command = " ".join(("pipeline", name, *spec.args))
        after = f"`pipeline verify {DATA}/{spec.output}`" if spec.verify_after else "—"
        inputs, gpus = ", ".join(spec.inputs) or "—", "yes" if spec.gpus else "no"
        rows.append(f"| {name} | {inputs} | {spec.output} | {gpus} | `{command}` | {after} |")
    return "\n".join(rows) + "\n"
