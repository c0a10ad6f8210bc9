"""What ``pipeline evaluate`` shows: one row per decoding method and phase, a markdown table, one plot.

Owns the comparison, pure: each method's phase against the ``none`` engine's same phase (speed-up of output
tokens/s over whole requests, decode speed-up of the time per output token after the first at batch 1,
greedy equality prompt by prompt), and the acceptance from the phase's own counters
(measure.acceptance_from_counters). The plot (matplotlib, Agg) draws what the rows hold, nothing more.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.ondisk.atomic import atomic_path
from pipeline.specdec.measure import Method, acceptance_from_counters


def _none_mean(results: list[dict], key: str) -> dict[str, float]:
    """Per phase, the mean of ``key`` over every ``none`` engine's run of it (the first, and the one run
    again after the others where evaluate brackets them); phases without ``key`` are left out."""
    nones = [r for r in results if r["method"]["name"] == "none"]
    values = {phase: [n["phases"][phase].get(key) for n in nones] for phase in nones[0]["phases"]}
    return {phase: sum(v) / len(v) for phase, v in values.items() if None not in v}


def baseline_speed(results: list[dict]) -> dict[str, float]:
    """Per phase, the output tok/s the speed-ups are taken against: the mean of every ``none`` engine's."""
    return _none_mean(results, "output_tokens_per_s")


def drift(results: list[dict]) -> dict[str, float]:
    """Per phase, how far the last ``none`` engine's output tok/s moved from the first's (a fraction of the
    first): what engines of the same settings differ by, so speed-ups within it are noise. Empty with one
    ``none`` engine."""
    nones = [r for r in results if r["method"]["name"] == "none"]
    if len(nones) < 2:
        return {}
    first, last = nones[0]["phases"], nones[-1]["phases"]
    return {
        phase: abs(last[phase]["output_tokens_per_s"] - first[phase]["output_tokens_per_s"])
        / first[phase]["output_tokens_per_s"]
        for phase in first
    }


def rows(results: list[dict]) -> list[dict]:
    """One row per (method, phase); ``results`` are measure.run_engine's, the ``none`` method's first.
    Greedy equality is against that first ``none``; speed-ups against baseline_speed."""
    base = {phase: r for phase, r in results[0]["phases"].items()}
    speed = baseline_speed(results)
    tpot = _none_mean(results, "tpot_ms")  # batch 1: the decode rate, without each request's first token
    out = []
    for result in results:
        method = result["method"]
        label = Method(**method).label
        for phase, r in result["phases"].items():
            same = [a == b for a, b in zip(r["tokens"], base[phase]["tokens"], strict=True)]
            row = {
                "method": method["name"],
                "k": method["k"],
                "label": label,
                "phase": phase,
                "output_tokens": r["output_tokens"],
                "output_tokens_per_s": r["output_tokens_per_s"],
                "speedup": r["output_tokens_per_s"] / speed[phase],
                "decode_speedup": tpot[phase] / r["tpot_ms"] if r.get("tpot_ms") and phase in tpot else None,
                "greedy_equal": all(same),
                "greedy_equal_prompts": sum(same),
                "prompts": len(same),
                **{k: r[k] for k in ("ttft_ms", "tpot_ms", "batch") if k in r},
                **acceptance_from_counters(r["counters"]),
                "measured_at": result.get("finished_at"),
                "reused": bool(result.get("reused")),
            }
            out.append(row)
    return out


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(table: list[dict]) -> str:
    """The rows as one markdown table, batch 1 first."""
    lines = [
        "| phase | method | acceptance length | per position | output tok/s | speed-up | TPOT ms "
        "| decode speed-up | greedy equal |",
        "|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for phase in ("batch1", "batched"):
        for r in (r for r in table if r["phase"] == phase):
            where = "batch 1" if phase == "batch1" else f"batch {r.get('batch', '?')}"
            per = " ".join(f"{p:.2f}" for p in r["per_position"]) or "-"
            equal = f"{r['greedy_equal_prompts']}/{r['prompts']}"
            lines.append(
                f"| {where} | {r['label']} | {_num(r['acceptance_length'], '.3f')} | {per} | "
                f"{r['output_tokens_per_s']:,.1f} | {r['speedup']:.2f}x | {_num(r.get('tpot_ms'), '.2f')} | "
                f"{_num(r.get('decode_speedup'), '.2f')}{'x' if r.get('decode_speedup') else ''} | {equal} |"
            )
    reused = sorted({f"{r['label']} ({r['measured_at']})" for r in table if r.get("reused")})
    if reused:  # speeds measured in another run: the reader weighs them knowing so
        lines += ["", f"Reused from an earlier run of the same engine settings: {', '.join(reused)}."]
    return "\n".join(lines) + "\n"


def plot(table: list[dict], target: Path) -> Path:
    """Acceptance length and speed-up per method, one panel each, a bar per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in table))
    phases = list(dict.fromkeys(r["phase"] for r in table))
    fig, (acc, speed) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(phases)
    for i, phase in enumerate(phases):
        by = {r["label"]: r for r in table if r["phase"] == phase}
        xs = [j + i * width for j in range(len(labels))]
        acc.bar(xs, [by[lb]["acceptance_length"] or 1.0 for lb in labels], width, label=phase)
        speed.bar(xs, [by[lb]["speedup"] for lb in labels], width, label=phase)
    for ax, title in ((acc, "acceptance length (vLLM counters)"), (speed, "output tok/s vs. no speculation")):
        ax.set_xticks([j + width * (len(phases) - 1) / 2 for j in range(len(labels))], labels, rotation=30)
        ax.set_title(title)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.legend()
    with atomic_path(target) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return target
