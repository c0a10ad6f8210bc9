"""The stage table: for each pipeline stage, what it reads and writes under the host's data root, its
container command, and how ops runs it (GPUs, what it needs of the host's inference server: stopped or up,
parallel layout, preflight, verification after it).

The one source of ops' stage plans (ops/stage.py), of compose.yaml's stage services (ops/composefile.py
renders them; tests/ops/test_ops_compose.py checks the committed file against it) and of the folder names
the demo uses (pipeline/demo/run.py), so a host prepared by hand, by compose and by ops has one layout.
"""

from __future__ import annotations

from dataclasses import dataclass

DATA, MODEL, CACHE = "/data", "/model", "/cache"  # where the container sees the data root, model and cache
# what a stage needs of the host's inference server (StageSpec.server)
SERVER_STOPPED = "stopped"  # the GPUs free: ops stops the server and proves the GPUs clean first
SERVER_UP = "up"  # the server answering: the stage is its client; ops never stops it
SERVER_KEPT = "kept"  # neither: the stage needs no GPU and no server; ops leaves the server as it is


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
    # extraction preflight that checks the argv first (one process either way);
    # "check": `pipeline STAGE ARGV --check`, the stage's own check of its inputs, output folder and what it
    # reaches (regenerate: the server answers, serves the hosts file's model, renders a chat), writing nothing
    preflight: str = "args"
    # check names that refuse the run ("" = every failed check); others are reported as warnings
    fatal: tuple[str, ...] = ()
    compose_vars: tuple[tuple[str, str, str], ...] = ()  # (argv word, compose variable, its default)
    # what the stage needs of the host's inference server: SERVER_STOPPED (ops stops it, frees and proves the
    # GPUs clean, restores it on --restore-server), SERVER_UP (never stopped, no gpu-clean, nothing to
    # restore; the container reaches it on the host's network: --network host), or SERVER_KEPT (prepare and
    # weights: no GPU, no server; never stopped, no gpu-clean, nothing to restore, the container's own
    # network; on Kimi-K2.5 each stop costs an 18-minute load when the server comes back). verify stays
    # SERVER_STOPPED: its `--model` recompute runs the target on the GPUs.
    server: str = SERVER_STOPPED


STAGES: dict[str, StageSpec] = {
    # the host's running server rewrites the conversations' answers: what prepare then reads
    # (`-- --data /data/regenerated/conversations.jsonl`); the endpoint and model come from the hosts file
    "regenerate": StageSpec(
        ("conversations.jsonl",),
        "regenerated",
        ("--data", f"{DATA}/conversations.jsonl", "--out", f"{DATA}/regenerated"),
        False,
        uses_model=False,
        gpus=False,
        preflight="check",
        compose_vars=((f"{DATA}/conversations.jsonl", "REGENERATE_DATA", f"{DATA}/conversations.jsonl"),),
        server=SERVER_UP,
    ),
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
        server=SERVER_KEPT,
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
    "weights": StageSpec(
        (), "verifier", ("--model", MODEL, "--out", f"{DATA}/verifier"), True, gpus=False, server=SERVER_KEPT
    ),
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
    # the trained draft in vLLM against no speculation and n-gram lookup, on held-out prompts
    "evaluate": StageSpec(
        ("train", "prompts.jsonl"),
        "evaluate",
        (
            "--model",
            MODEL,
            "--draft",
            f"{DATA}/train",
            "--prompts",
            f"{DATA}/prompts.jsonl",
            "--out",
            f"{DATA}/evaluate",
        ),
        False,
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


SERVER_WORDS = {SERVER_STOPPED: "stopped", SERVER_UP: "up, never stopped", SERVER_KEPT: "left as it is"}


def markdown_table() -> str:
    """The table as docs/ops.md shows it (between its `stages:begin`/`stages:end` markers; a test holds the
    two equal): inputs, output, GPUs, the server, the container command and what ops runs after it."""
    rows = [
        "| stage | inputs under data root | output | GPUs | server | container command | after it |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, spec in STAGES.items():
        command = " ".join(("pipeline", name, *spec.args))
        after = f"`pipeline verify {DATA}/{spec.output}`" if spec.verify_after else "—"
        inputs, gpus = ", ".join(spec.inputs) or "—", "yes" if spec.gpus else "no"
        server = SERVER_WORDS[spec.server]
        rows.append(f"| {name} | {inputs} | {spec.output} | {gpus} | {server} | `{command}` | {after} |")
    return "\n".join(rows) + "\n"
