"""States modes side by side (issue #31): the online/hybrid budget between the least the train stage
accepts and the offline set, one row of figures per mode from its train phase, and the comparison with
offline's acceptance and speed. Shared by bench/learned_bench.py (a learned target: acceptance) and
bench/train_bench.py (the random GPU shapes: speed), and bench/reader_start_bench.py; pure but for
``offline_budget``, which reads the set.
"""

from __future__ import annotations

import click

STATES_SHARE = 0.5  # online/hybrid budget: the minimum plus this share of the offline set beyond it
ACCEPTANCE_TOLERANCE = 0.05  # issue #31: every states mode within this of offline's acceptance at k=3


def least_budget(produced) -> int:
    """The least --states-budget the train stage accepts for a run it planned (``produced_inputs``' second
    value, pipeline/train/stage.py): the states kept for the whole run (held-out and acceptance-baseline
    samples: online keeps nothing else) plus the largest training sample."""
    return produced.plan.kept_bytes + max(produced.sizes[i] for i in produced.train)


def budget_between(minimum: int, offline_bytes: int, share: float = STATES_SHARE) -> int:
    """The online/hybrid budget: the least the train stage accepts plus ``share`` of what the offline set
    holds beyond it, so that online deletes what it reads and hybrid keeps only part of the set."""
    return minimum + int(share * max(offline_bytes - minimum, 0))


def offline_budget(cfg) -> tuple[int, int]:
    """The least budget and ``budget_between``'s for produced runs of ``cfg``'s draft against the offline
    set in ``cfg.data`` (a TrainConfig; the states made by the hf backend): planned by the train stage with
    room enough, which reads the set and the configs and loads no model."""
    import dataclasses

    from pipeline.train.inputs import produced_inputs
    from pipeline.train.states import state_file_bytes

    probe = dataclasses.replace(cfg, states_mode="online", states_budget=str(2**60), states_backend="hf")
    minimum = least_budget(produced_inputs(probe)[1])
    return minimum, budget_between(minimum, state_file_bytes(probe.data))


def mode_row(mode: str, phase: dict) -> dict:
    """One states mode's figures from its train phase: the acceptance at k=3, the stage's wall seconds, the
    trainer's tokens/s (training tokens / its epochs' seconds, waits for states included), the same after
    epoch 0 (whose seconds hold the draft's torch.compile warm-up: a cold compile cache in whichever mode
    runs first would otherwise decide the ratio) and, for online/hybrid, where the time went (the trainer
    waiting for states, the producer waiting for room)."""
    tr = phase["train"]
    st = tr.get("states") or {}
    later = tr.get("epoch_seconds", [])[1:]
    return {
        "mode": mode,
        "acceptance_length": phase["eval"]["draft"]["acceptance_length"],
        "train_wall_s": phase["seconds"],
        "train_tokens_per_s": tr["train_tokens_per_s"],
        "later_tokens_per_s": (
            round(tr["train_tokens_per_epoch"] * len(later) / sum(later), 1) if sum(later) > 0 else None
        ),
        "trainer_wait_s": st.get("trainer_wait_seconds"),
        "producer_wait_s": st.get("producer_room_wait_seconds"),
        "capture_s": st.get("capture_seconds"),
        "kept_samples": st.get("kept_samples"),
        "produced_samples": st.get("produced_samples"),
        "peak_bytes": st.get("peak_bytes"),
        "phase_seconds": tr.get("phase_seconds") or {},  # pipeline/train/stage.py PhaseClock
    }


PHASES = (  # the stage's phase_seconds keys, in the order a run passes them, and their columns
    ("setup", "setup s"),
    ("training", "training s"),
    ("training_validation", "of it validation s"),
    ("training_checkpoints", "of it checkpoints s"),
    ("states_finish", "states finish s"),
    ("export", "export s"),
    ("evaluation", "evaluation s"),
)


def phase_lines(rows: list[dict]) -> list[str]:
    """Where each mode's stage wall time went beyond its epochs (the stage's ``phase_seconds``), as a
    markdown table; none when no row has them (a stage older than them)."""
    if not any(r.get("phase_seconds") for r in rows):
        return []
    lines = [
        "| mode | " + " | ".join(title for _, title in PHASES) + " |",
        "|---|" + "---|" * len(PHASES),
    ]
    for r in rows:
        ph = r.get("phase_seconds") or {}
        cells = ["-" if ph.get(key) is None else f"{ph[key]:.1f}" for key, _ in PHASES]
        lines.append(f"| {r['mode']} | " + " | ".join(cells) + " |")
    return lines


def compare_modes(rows: list[dict], tolerance: float = ACCEPTANCE_TOLERANCE) -> tuple[list[str], list[str]]:
    """Every mode's row against offline's: adds the deltas to ``rows``; returns the markdown tables (the
    modes' figures, then where their wall time went: ``phase_lines``) and one reason per mode whose
    acceptance is more than ``tolerance`` from offline's."""
    base = next(r for r in rows if r["mode"] == "offline")
    lines = [
        "| mode | acceptance k=3 | delta vs offline | train wall s | training tok/s | tok/s vs offline "
        "| after epoch 0: tok/s | vs offline | trainer wait s | producer wait s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    failures = []
    for r in rows:
        delta = r["acceptance_length"] - base["acceptance_length"]
        r["acceptance_delta"] = round(delta, 4)
        r["tokens_per_s_vs_offline"] = round(r["train_tokens_per_s"] / base["train_tokens_per_s"], 3)
        later = r["later_tokens_per_s"], base["later_tokens_per_s"]
        r["later_vs_offline"] = round(later[0] / later[1], 3) if None not in later else None
        steady = (
            ("-", "-")
            if r["later_vs_offline"] is None
            else (f"{later[0]:,.0f}", f"{r['later_vs_offline']:.2f}x")
        )
        if abs(delta) > tolerance:
            failures.append(
                f"{r['mode']} acceptance {r['acceptance_length']:.3f} is {delta:+.3f} from offline's "
                f"{base['acceptance_length']:.3f} (more than {tolerance})"
            )
        waits = ["-" if r[k] is None else f"{r[k]:.1f}" for k in ("trainer_wait_s", "producer_wait_s")]
        lines.append(
            f"| {r['mode']} | {r['acceptance_length']:.3f} | {delta:+.3f} | {r['train_wall_s']:.1f} "
            f"| {r['train_tokens_per_s']:,.0f} | {r['tokens_per_s_vs_offline']:.2f}x | {' | '.join(steady)} "
            f"| {' | '.join(waits)} |"
        )
    phases = phase_lines(rows)
    return lines + ([""] + phases if phases else []), failures


PRODUCERS = ("thread", "process")  # pipeline train --states-producer, where a vllm producer's engine runs


def split_mode(token: str) -> tuple[str, str | None]:
    """A ``--states-modes`` entry: the states mode and, after a colon, where the vllm producer's engine
    runs (``online:process``: ``--states-producer process``; none: the stage's auto)."""
    mode, _, producer = token.partition(":")
    return mode, producer or None


def parse_modes(ctx, param, value: str) -> list[str]:
    """``--states-modes``: offline (the reference) first, then the others listed, each once; a produced mode
    may name its producer's place (``online:process``, ``hybrid:thread``)."""
    from pipeline.train.states import MODES

    def valid(token: str) -> bool:
        mode, producer = split_mode(token)
        return mode in MODES and (producer is None or (producer in PRODUCERS and mode != "offline"))

    modes = [m.strip() for m in value.split(",") if m.strip()]
    if not all(map(valid, modes)) or "offline" not in modes:
        raise click.BadParameter(
            f"a comma-separated list of {', '.join(MODES)} that includes offline (online and hybrid may "
            f"add :{' or :'.join(PRODUCERS)}, where the vllm producer runs)"
        )
    return ["offline", *dict.fromkeys(m for m in modes if m != "offline")]
