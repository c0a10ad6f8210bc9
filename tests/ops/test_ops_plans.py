"""Stage and clean plans are exact argv / requests, computed without touching a host."""

from __future__ import annotations

import csv
import shlex

import pytest

from ops.agent import command, probe_request, terminate_request
from ops.errors import ConfigError
from ops.hosts import HostConfig
from ops.stage import expected_output_bytes, plan_stage


def host(**kw) -> HostConfig:
    base = dict(name="box", host="box", data_root="/srv/d", model_dir="/srv/m", cache_dir="/srv/c", image="img:1")
    base.update(kw)
    return HostConfig(**base)


def test_extract_plan_exact_argv():
    """remote-extract's container: name, labels, host IPC, all GPUs, mounts (model read-only), entrypoint."""
    plan = plan_stage(host(), "extract", run_id="r1")
    assert plan.docker_run == (
        "docker", "run", "--detach", "--name", "eagle-r1",
        "--label", "eagle-ops.run-id=r1", "--label", "eagle-ops.stage=extract",
        "--label", "eagle-ops.output=/srv/d/hidden_states", "--label", "eagle-ops.host=box",
        "--ipc", "host", "--mount", "type=bind,source=/srv/d,target=/data",
        "--mount", "type=bind,source=/srv/c,target=/cache", "--env", "EAGLE_RUN_ID=r1", "--env", "HF_HOME=/cache/hf",
        "--mount", "type=bind,source=/srv/m,target=/model,readonly", "--gpus", "all",
        "--entrypoint", "/bin/sh", "img:1", "-c",
        "python -m pipeline extract --prepared /data/prepared --model /model --out /data/hidden_states --no-progress",
    )
    assert plan.host_inputs == ("/srv/d/prepared",) and plan.host_output == "/srv/d/hidden_states"


def test_resume_extra_args_and_verify_after():
    """--resume and extra args reach the stage command; stages other than extract/verify verify after."""
    plan = plan_stage(host(docker_gpus=""), "extract", run_id="r2", resume=True, extra_args=("--limit", "5"))
    assert plan.stage_argv[-3:] == ("--resume", "--limit", "5") and "--gpus" not in plan.docker_run
    weights = plan_stage(host(), "weights", run_id="r3")
    assert weights.docker_run[-1] == ("python -m pipeline weights --model /model --out /data/verifier && "
                                      "python -m pipeline verify /data/verifier")


def test_hostile_paths_stay_data():
    """A data root with spaces, quotes, commas and $(...) becomes one CSV-quoted --mount field and one
    shell word; nothing of it is left for a shell to interpret."""
    evil = "/srv/a b,'c' \"d\" $(touch x)"
    plan = plan_stage(host(data_root=evil), "prepare", run_id="r4")
    mount = plan.docker_run[plan.docker_run.index("--mount") + 1]
    assert next(csv.reader([mount])) == ["type=bind", f"source={evil}", "target=/data"]  # how docker parses it
    assert shlex.split(shlex.join(plan.docker_run)) == list(plan.docker_run)


@pytest.mark.parametrize("bad", ["", "a b", "x;y", "$(id)", "a" * 101])
def test_bad_run_ids(bad):
    """Run ids are names, not shell text."""
    with pytest.raises(ConfigError):
        plan_stage(host(), "extract", run_id=bad)


def test_expected_output_bytes_formula():
    """samples x tokens (= all tokens) x hidden x 4 layers x 2 bytes."""
    assert expected_output_bytes(num_tokens=1_000_000, hidden_size=7168) == 1_000_000 * 7168 * 4 * 2


def test_agent_requests():
    """The agent is one fixed command line; what to do travels as JSON on stdin."""
    h = host(python="/usr/bin/python3", device_glob="/dev/nvidia*")
    assert command(h).startswith("/usr/bin/python3 -c ")
    assert probe_request(h) == {"op": "probe", "device_glob": "/dev/nvidia*", "gpu_source": "nvml",
                                "server": {"kind": "none", "target": ""}}
    assert terminate_request([(5, 77)], [9], grace=1, kill_wait=2) == {
        "op": "terminate", "targets": [{"pid": 5, "starttime": 77}], "groups": [9], "grace": 1, "kill_wait": 2}
