"""compose.yaml and the stage table (contract/stages.py) are one source: the committed file is the rendering
of the table, and what the real compose binary makes of it (commands, mounts, environment, GPUs, privileges)
is what ops plans."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ops import composefile
from ops.hosts import HostConfig
from ops.layout import Layout
from ops.stage import STAGES, container_env, plan_stage, stage_mounts

COMPOSE = Path(sys.executable).parent / "docker-compose"
REPO = Path(__file__).resolve().parents[2]


def compose_config(path: Path = REPO / "compose.yaml") -> dict:
    """`docker-compose config` of every profile, with none of the file's variables set."""
    if not COMPOSE.exists():
        pytest.skip(f"no compose binary at {COMPOSE}")
    env = {
        k: v
        for k, v in os.environ.items()
        if not re.match(r"^(EAGLE_|SERVE_|HF_|[A-Z]+_ARGS$|[A-Z]+_BACKEND$)", k)
    }
    res = subprocess.run(
        [str(COMPOSE), "-f", str(path), "--profile", "*", "config", "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_committed_compose_file_is_the_rendered_table():
    """compose.yaml is exactly what `python -m ops.composefile` renders from the stage table (no hand
    edits)."""
    assert (REPO / "compose.yaml").read_text() == composefile.render()
    res = subprocess.run(
        [sys.executable, "-m", "ops.composefile", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr


def test_compose_stage_services_agree_with_ops_plans():
    """Per stage, compose's command is ops' stage argv (layout: vllm, compose's default, with the tensor
    parallel size left to the pipeline), its mounts are ops' container paths (model read-only, none for
    verify), the caches' environment is ops', GPUs exactly where ops passes --gpus, and the privileges are
    ops'."""
    services = compose_config()["services"]
    host = HostConfig(name="h", host="local")
    env = dict(container_env("r"))
    for stage, spec in STAGES.items():
        svc = services[stage]
        plan = plan_stage(host, stage, run_id="r", layout=Layout("vllm", 1, 1) if spec.layout else None)
        want = list(plan.stage_argv)
        if spec.layout:  # compose leaves the tensor parallel size to the pipeline (all visible devices)
            i = want.index("--tensor-parallel-size")
            del want[i : i + 2]
        assert svc["command"] == want, stage
        mounts = sorted((v["target"], bool(v.get("read_only"))) for v in svc["volumes"])
        assert mounts == sorted((dst, ro) for _, dst, ro in stage_mounts(host, spec)), stage
        caches = ("HF_HOME", "HOME", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT")
        assert {k: svc["environment"][k] for k in caches} == {k: env[k] for k in caches}
        assert ("deploy" in svc) == ("--gpus" in plan.docker_run), stage
        # the host's network for the server-up stage alone (it asks the server on the host's loopback)
        assert (svc.get("network_mode") == "host") == ("--network" in plan.docker_run), stage
        assert ("--network" in plan.docker_run) == (spec.server == "up"), stage
        assert svc["cap_drop"] == ["ALL"] and svc["read_only"] is True and svc["ipc"] == "private"
        assert (
            str(svc["shm_size"]) == str(16 * 2**30)
            and host.stage_shm_size == "16g"
            and svc["pids_limit"] == host.stage_pids_limit
        )


def test_compose_preflight_service_is_ops_extract_preflight():
    """The preflight service runs the `pipeline preflight` that ops runs before remote-extract, same
    values."""
    svc = compose_config()["services"]["preflight"]
    plan = plan_stage(HostConfig(name="h", host="local"), "extract", run_id="r", layout=Layout("vllm", 1, 1))
    ops_preflight = plan.preflight_run[-1].split(" --fail-fast-on ")[0].split()  # before the argv check
    ops_preflight = [w for w in ops_preflight if w not in ("--tensor-parallel-size", "1")]
    assert svc["command"][: len(ops_preflight)] == ops_preflight


def test_the_agreement_test_sees_a_drift(tmp_path):
    """A compose file whose extract output folder was renamed by hand (the old `hidden`) fails the
    agreement."""
    drifted = tmp_path / "compose.yaml"
    drifted.write_text(
        (REPO / "compose.yaml").read_text().replace("--out /data/hidden_states", "--out /data/hidden")
    )
    assert drifted.read_text() != composefile.render()
    extract = compose_config(drifted)["services"]["extract"]
    plan = plan_stage(HostConfig(name="h", host="local"), "extract", run_id="r")
    assert extract["command"][: len(plan.stage_argv)] != list(plan.stage_argv)
