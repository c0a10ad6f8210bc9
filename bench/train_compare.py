"""Benchmark: `pipeline train` against speculators 0.9's own `speculators train`, same set, same GPU, one run.

Issue #17 item 5. Both trainers get one set: ours reads what `prepare` + `extract` wrote; speculators reads
`pipeline export-speculators`' copy of it (its Arrow dataset and vLLM-layout ``hs_{i}.safetensors``), with
the flags the export records. Each tool runs as its own process with its own defaults, except the ones the
comparison must hold equal: epochs, tokens per packed batch (our ``--max-len`` = its ``--total-seq-len``),
learning rate, TTT steps and the seed. Both hold out 10% of the samples and train the same EAGLE-3 draft
(speculators' model, one layer, KL loss), on the same samples: ours with ``--held-out last``, speculators
with ``--train-data-ratio 0.9`` on rows written in sample order (before 2026-12-02 18:27 ours held out a
seeded shuffle's share, so the two validation losses were over different samples).

The runs alternate (ours, speculators) at ``--epochs-short`` and then at ``--epochs-long`` epochs, so the
GPU's state is shared as evenly as one run allows. Per run: whole-process seconds, seconds inside the
training epochs (ours: its summary's ``train_seconds``; speculators: the time between its "Training epoch
i/n started" and "completed" log lines), tokens of the training split per second of those epochs, the
marginal rate ``tokens x (long - short) / (epochs seconds long - short)`` (start-up, the compile warm-up and
the first epoch's caches cancel), mean GPU utilisation and peak GPU memory (NVML, every 0.5 s, whole
process), and the last validation loss each tool reports.

    python -m bench.train_compare --workdir /tmp/bl                        # a set bench/learned_bench.py left
    python -m bench.train_compare --workdir /tmp/w1 --build llama-1b       # builds the 1.5B random set first

``--workdir`` must hold ``prepared/``, ``hidden_states/``, ``verifier/`` and ``model/`` (the layout
learned_bench and train_bench write).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click

from bench.learned_bench import GpuSampler, train_flags
from bench.timing import timed
from bench.train_bench import Report

# The draft and optimizer `pipeline train` builds (pipeline/train/draft.py: speculators'
# Eagle3SpeculatorConfig defaults; speculators' Trainer defaults to AdamW), which `speculators train`'s CLI
# defaults differ from: it picks Muon and the "Eagle 3.1" norms. With these flags both tools train the same
# model the same way.
SAME_DRAFT = ("--optimizer", "adamw", "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output")
EPOCH_LINE = re.compile(r"Training epoch (\d+)/(\d+) (started|completed)")
TOOLS = ("ours", "speculators")
# both tools hold out this share, and the same samples: ours its last ones (`--held-out last`), speculators
# the last rows of the dataset export-speculators writes in sample order (`--train-data-ratio 1 - HELD_OUT`)
HELD_OUT = 0.1


def epoch_seconds(lines: list[tuple[float, str]]) -> float | None:
    """Seconds between each "Training epoch i/n started" line and its "completed" line, summed; None if
    an epoch never completed."""
    started: dict[str, float] = {}
    total, done = 0.0, 0
    for at, line in lines:
        if m := EPOCH_LINE.search(line):
            if m[3] == "started":
                started[m[1]] = at
            elif m[1] in started:
                total += at - started.pop(m[1])
                done += 1
    return total if done and not started else None


# speculators' step timer (speculators/train/trainer.py ``_StepTimer.profile``), which both tools run: each
# logged step's phases in ms, its tokens/s and the share of it spent waiting for the batch (fetch_frac).
PROFILE_FIELD = re.compile(r"profile/([a-z0-9_]+)=([0-9.e+-]+)")
PHASES = ("fetch_ms", "fwd_ms", "bwd_ms", "opt_ms", "step_ms")
Profile = dict[str, float]


def steady_rate(steps: list[Profile]) -> float | None:
    """Tokens per second over the logged steps after the first (which carries the compile and the first
    fetch)."""
    later = [s for s in steps[1:] if "tokens_per_s" in s and "step_ms" in s]
    seconds = sum(s["step_ms"] for s in later) / 1000
    if not later or seconds <= 0:
        return None
    return round(sum(s["tokens_per_s"] * s["step_ms"] / 1000 for s in later) / seconds, 1)


def steady_phases(steps: list[Profile]) -> dict | None:
    """Where a step's time went over the logged steps after the first: mean ms of each phase, and the share
    of the step spent getting its batch onto the device (``fetch_ms``: the wait for the loader plus the
    host-to-device copy, ``h2d_ms``, which is also given where logged)."""
    later = [s for s in steps[1:] if all(k in s for k in PHASES)]
    if not later:
        return None
    keys = PHASES + (("h2d_ms",) if all("h2d_ms" in s for s in later) else ())
    means = {k: round(sum(s[k] for s in later) / len(later), 2) for k in keys}
    total = sum(s["step_ms"] for s in later)
    return {**means, "fetch_share": round(sum(s["fetch_ms"] for s in later) / total, 3) if total else None}


def profiles_from_log(lines: list[tuple[float, str]]) -> list[Profile]:
    """Each step's profile fields as `speculators train` logged them (its console lines, in order, wherever
    rich wrapped them): a field seen again starts the next step."""
    steps: list[Profile] = []
    current: Profile = {}
    for _, line in lines:
        for key, value in PROFILE_FIELD.findall(line):
            if key in current:
                steps.append(current)
                current = {}
            current[key] = float(value)
    steps.append(current)
    return [s for s in steps if "tokens_per_s" in s and "step_ms" in s]


def profiles_from_metrics(out: Path) -> list[Profile]:
    """Each step's profile as our train wrote it to metrics.jsonl (val rows have none)."""
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return [
        {k: v for k, v in r["profile"].items() if isinstance(v, (int, float))}
        for r in rows
        if isinstance(r.get("profile"), dict)
    ]


def speculators_train_tokens(dataset: Path, train_ratio: float = 1 - HELD_OUT) -> int:
    """Tokens in the split `speculators train` trains on: its ArrowDataset's first ``int(N x ratio)`` rows."""
    from datasets import load_from_disk

    # plain Python rows: the torch formatter imports torchvision when it is installed, and some builds lack
    # what it imports (seen on the H200's image: torchvision.io.VideoReader)
    lengths = load_from_disk(str(dataset)).with_format(None)["seq_len"]
    return int(sum(lengths[: int(len(lengths) * train_ratio)]))


def val_figures(val: dict | None) -> dict:
    """The validation loss and TTT step 0..2 accuracies of one epoch record of speculators' trainer."""
    if not val or "loss_epoch" not in val:
        return {"val_loss": None}
    return {
        "val_loss": round(val["loss_epoch"], 5),
        "val_full_acc": [round(val[k], 4) for i in range(3) if (k := f"full_acc_{i}_epoch") in val],
    }


def last_val_speculators(save: Path) -> dict:
    """The validation record of the last epoch `speculators train` checkpointed."""
    epochs = sorted((int(p.name), p) for p in save.iterdir() if p.name.isdigit()) if save.is_dir() else []
    if not epochs or not (epochs[-1][1] / "val_metrics.json").is_file():
        return val_figures(None)
    return val_figures(json.loads((epochs[-1][1] / "val_metrics.json").read_text()))


def last_val_ours(out: Path) -> dict:
    """The validation record of our last epoch (metrics.jsonl keeps the records speculators' trainer logs)."""
    val = None
    metrics = out / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        rec = json.loads(line)
        if isinstance(rec.get("val"), dict):
            val = rec["val"]
    return val_figures(val)


def commands(
    work: Path, tool: str, epochs: int, opts: dict, record: dict, device: str
) -> tuple[list[str], Path]:
    """One tool's command line at ``epochs`` epochs, and the directory it writes."""
    common = {"max_len": opts["max_len"], "lr": opts["lr"], "seed": 0}
    if tool == "ours":
        out = work / f"cmp-ours-{epochs}"
        return (
            [
                sys.executable,
                "-m",
                "pipeline",
                "train",
                *train_flags(work, work / "hidden_states", out, epochs, common["max_len"], common["lr"]),
                "--seed",
                "0",
                "--device",
                device,
                "--eval-fraction",
                str(HELD_OUT),
                "--held-out",
                "last",
                "--no-eval",
                "--no-plots",
            ],
            out,
        )
    save = work / f"cmp-speculators-{epochs}"
    return (
        [
            sys.executable,
            "-m",
            "speculators",
            "train",
            "--data-path",
            str(work / "speculators"),
            *record["speculators_train_args"],
            "--train-data-ratio",
            str(1 - HELD_OUT),
            "--save-path",
            str(save),
            "--epochs",
            str(epochs),
            "--total-seq-len",
            str(common["max_len"]),
            "--lr",
            str(common["lr"]),
            "--ttt-steps",
            "3",
            "--seed",
            "0",
            "--log-dir",
            str(save / "logs"),
            *(() if opts.get("speculators_defaults") else SAME_DRAFT),
            *opts["speculators_extra"],
        ],
        save,
    )


def steady_figures(steps: list[Profile]) -> dict:
    """The steady-state figures of one run's step profiles."""
    return {"steady_tokens_per_s": steady_rate(steps), "steady_phase_ms": steady_phases(steps)}


def run_one(
    work: Path, tool: str, epochs: int, opts: dict, record: dict, device: str, env: dict, tag: str = ""
) -> dict:
    """One training process with its GPU figures (its exit code and last lines when it fails); its output goes
    to ``cmp-TOOL-EPOCHS[TAG].log`` in ``work``."""
    argv, out = commands(work, tool, epochs, opts, record, device)
    shutil.rmtree(out, ignore_errors=True)
    if tool == "speculators":
        out.mkdir(parents=True)  # its log dir and checkpoints go under it
    click.echo(f"\n$ {shlex.join(argv)}", err=True)
    with GpuSampler() as gpu:
        run = timed(
            argv,
            {**env, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
            log=work / f"cmp-{tool}-{epochs}{tag}.log",
        )
    wall, rc, lines = run.wall, run.returncode, run.lines
    figures = {"command": shlex.join(argv), "exit_code": rc, "wall_seconds": round(wall, 1), **gpu.figures()}
    if rc != 0:
        figures["error_tail"] = [line for _, line in lines[-12:]]
        return figures
    try:  # a figure that cannot be read is reported as such; the run's other figures stay
        if tool == "ours":
            train = json.loads((out / "summary.json").read_text())["train"]
            figures.update(
                epoch_seconds=train["train_seconds"],
                tokens_per_epoch=train["train_tokens_per_epoch"],
                **steady_figures(profiles_from_metrics(out)),
                **last_val_ours(out),
            )
        else:
            figures.update(
                epoch_seconds=epoch_seconds(lines),
                tokens_per_epoch=speculators_train_tokens(work / "speculators"),
                **steady_figures(profiles_from_log(lines)),
                **last_val_speculators(out),
            )
    except Exception as exc:  # noqa: BLE001 - e.g. a library of the host that the reader trips on
        figures.update(epoch_seconds=None, figures_error=f"{type(exc).__name__}: {exc}"[:300])
    if figures.get("epoch_seconds"):
        figures["tokens_per_s"] = round(figures["tokens_per_epoch"] * epochs / figures["epoch_seconds"], 1)
    return figures


def marginal(short: dict, long: dict, epochs: tuple[int, int]) -> float | None:
    """Tokens per second of the epochs the long run trained beyond the short one."""
    if not (short.get("epoch_seconds") and long.get("epoch_seconds")):
        return None
    extra = long["epoch_seconds"] - short["epoch_seconds"]
    return round(long["tokens_per_epoch"] * (epochs[1] - epochs[0]) / extra, 1) if extra > 0 else None


def no_marginal_reason(short: dict, long: dict) -> str | None:
    """Why :func:`marginal` gives no rate although both runs timed their epochs, or None."""
    a, b = short.get("epoch_seconds"), long.get("epoch_seconds")
    if a and b and b <= a:
        return (
            f"the long run's epochs took {b:.1f} s, no more than the short run's {a:.1f} s (the short run "
            "paid a cold compile or first read that the long run found cached); compare the steady rates"
        )
    return None


@click.command()
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    required=True,
    help="A set: prepared/, hidden_states/, verifier/, model/.",
)
@click.option(
    "--build",
    type=click.Choice(["tiny", "llama-1b"]),
    default=None,
    help="First build the set with bench/train_bench.py's random target of this preset (replaces --workdir).",
)
@click.option(
    "--conversations", type=int, default=None, help="With --build: override the preset's conversation count."
)
@click.option("--epochs-short", type=int, default=1, show_default=True)
@click.option("--epochs-long", type=int, default=3, show_default=True)
@click.option(
    "--max-len", type=int, default=8192, show_default=True, help="Tokens per packed batch, both tools."
)
@click.option("--lr", type=float, default=5e-4, show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto (cuda when there is one) | cpu.")
@click.option(
    "--speculators-env",
    multiple=True,
    help="KEY=VALUE for speculators' process only (e.g. a CPU shim's PYTHONPATH).",
)
@click.option(
    "--speculators-arg", multiple=True, help="One more word for `speculators train` (repeat; e.g. CPU flags)."
)
@click.option(
    "--speculators-defaults",
    is_flag=True,
    help="Run `speculators train` with its own draft/optimizer defaults (Muon, Eagle 3.1 norms) "
    "instead of ours.",
)
@click.option(
    "--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write figures here."
)
def main(
    workdir: Path,
    build: str | None,
    conversations: int | None,
    epochs_short: int,
    epochs_long: int,
    max_len: int,
    lr: float,
    device: str,
    speculators_env: tuple[str, ...],
    speculators_arg: tuple[str, ...],
    speculators_defaults: bool,
    json_path: Path | None,
) -> None:
    """Train the same draft on the same set with ours and with speculators' CLI; print one table."""
    import torch

    if epochs_long <= epochs_short:
        raise click.BadParameter(
            f"{epochs_long} must exceed --epochs-short {epochs_short}", param_hint="--epochs-long"
        )
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    report = Report(json_path)
    report.data.update(
        command=shlex.join(["python", "-m", "bench.train_compare", *sys.argv[1:]]),
        device=device,
        epochs=[epochs_short, epochs_long],
        max_len=max_len,
        lr=lr,
    )
    if build:
        from bench.train_bench import build_random_set

        built = build_random_set(workdir, build, conversations, report)
        report.data["set"] = {k: built[k] for k in ("parameters", "vocab", "seq_length", "samples", "tokens")}
    missing = [n for n in ("prepared", "hidden_states", "verifier", "model") if not (workdir / n).is_dir()]
    if missing:
        raise SystemExit(
            f"train_compare: {workdir} has no {', '.join(missing)}: give a set bench/learned_bench.py "
            f"left (--keep-states) or pass --build"
        )

    t0 = time.perf_counter()
    shutil.rmtree(workdir / "speculators", ignore_errors=True)
    rc = subprocess.call(
        [
            sys.executable,
            "-m",
            "pipeline",
            "export-speculators",
            "--prepared",
            str(workdir / "prepared"),
            "--data",
            str(workdir / "hidden_states"),
            "--out",
            str(workdir / "speculators"),
        ]
    )
    if rc != 0:
        raise SystemExit(f"train_compare: export-speculators failed with exit code {rc}")
    record = json.loads((workdir / "speculators" / "eagle-ops.json").read_text())
    report.phase("export", time.perf_counter() - t0)

    env = dict(os.environ)
    spec_env = {**env, **dict(kv.split("=", 1) for kv in speculators_env)}
    opts = {
        "max_len": max_len,
        "lr": lr,
        "speculators_extra": speculators_arg,
        "speculators_defaults": speculators_defaults,
    }
    runs: dict[str, dict[int, dict]] = {tool: {} for tool in TOOLS}
    for epochs in (epochs_short, epochs_long):
        for tool in TOOLS:
            default_loss = tool == "speculators" and "--loss-implementation" not in opts["speculators_extra"]
            fig = run_one(
                workdir,
                tool,
                epochs,
                opts,
                record,
                device,
                spec_env if tool == "speculators" else env,
                tag="-default-loss" if default_loss else "",
            )
            if default_loss and fig["exit_code"] != 0:
                # its default fused loss failed on the H200 before (pipeline/train/stage.py
                # loss_implementation): keep the failure in the report, then compare with the eager loss
                # ours uses
                report.data["speculators_default_failed"] = fig
                report.write()
                opts["speculators_extra"] = (*opts["speculators_extra"], "--loss-implementation", "eager")
                fig = run_one(workdir, tool, epochs, opts, record, device, spec_env)
            runs[tool][epochs] = fig
            report.data["runs"] = runs
            report.phase(
                f"{tool}-{epochs}", fig["wall_seconds"], **{k: v for k, v in fig.items() if k != "command"}
            )
    for tool in TOOLS:
        report.data.setdefault("marginal_tokens_per_s", {})[tool] = marginal(
            runs[tool][epochs_short], runs[tool][epochs_long], (epochs_short, epochs_long)
        )
    report.write()

    click.echo(
        "\n| tool | epochs | whole process s | epochs s | tokens/s (epochs) | "
        "tokens/s (steps after the first) | fetch share of a step "
        "| GPU util % | peak GPU GiB | last val loss [step accuracies] |"
    )
    click.echo("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for epochs in (epochs_short, epochs_long):
        for tool in TOOLS:
            f = runs[tool][epochs]
            if f["exit_code"] != 0:
                click.echo(f"| {tool} | {epochs} | failed (exit {f['exit_code']}) | | | | | | | |")
                continue
            click.echo(
                f"| {tool} | {epochs} | {f['wall_seconds']:.1f} | {f['epoch_seconds'] or 0:.1f} | "
                f"{f.get('tokens_per_s', 0):,.0f} | {f.get('steady_tokens_per_s') or 0:,.0f} | "
                f"{(f.get('steady_phase_ms') or {}).get('fetch_share', '-')} | "
                f"{f.get('gpu_util_mean_pct', '-')} | {f.get('gpu_mem_peak_gib', '-')} | "
                f"{f.get('val_loss')} {f.get('val_full_acc', '')} |"
            )
    m = report.data["marginal_tokens_per_s"]
    ratio = (m["ours"] / m["speculators"]) if m["ours"] and m["speculators"] else None
    click.echo(
        f"\nmarginal tokens/s ({epochs_long - epochs_short} epochs): "
        f"ours {m['ours']}, speculators {m['speculators']}"
        + (f" -> ours / speculators = {ratio:.2f}x" if ratio else "")
    )
    for tool in TOOLS:
        if why := no_marginal_reason(runs[tool][epochs_short], runs[tool][epochs_long]):
            click.echo(f"no marginal rate for {tool}: {why}")
    if any(runs[t][e]["exit_code"] != 0 for t in TOOLS for e in (epochs_short, epochs_long)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
