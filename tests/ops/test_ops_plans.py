"""Stage and clean plans are exact argv / requests, computed without touching a host."""

from __future__ import annotations

import csv
import os
import shlex

import pytest

from ops.agent import client_identity, command, probe_request, terminate_request
from ops.errors import ConfigError
from ops.hosts import HostConfig
from ops.secret_env import RedactingWriter, available, env_file_text, protect, redact, start_command
from ops.stage import plan_stage, resolve_user


def host(**kw) -> HostConfig:
    base = dict(
        name="box", host="box", data_root="/srv/d", model_dir="/srv/m", cache_dir="/srv/c", image="img:1"
    )
    base.update(kw)
    return HostConfig(**base)


def test_extract_plan_exact_argv():
    """remote-extract's container: name, labels, least privilege (user resolved later, no capability, no
    privilege gain, pids cap, read-only root with a private /tmp, private IPC with a sized /dev/shm), all
    GPUs, mounts (model read-only), entrypoint."""
    plan = plan_stage(host(), "extract", run_id="r1")
    assert plan.docker_run == (
        "docker",
        "run",
        "--detach",
        "--name",
        "eagle-r1",
        "--label",
        "eagle-ops.run-id=r1",
        "--label",
        "eagle-ops.stage=extract",
        "--label",
        "eagle-ops.output=/srv/d/hidden_states",
        "--label",
        "eagle-ops.host=box",
        "--user",
        "auto",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--pids-limit",
        "16384",
        "--read-only",
        "--tmpfs",
        "/tmp:rw,exec,nosuid,nodev,mode=1777",
        "--ipc",
        "private",
        "--shm-size",
        "16g",
        "--mount",
        "type=bind,source=/srv/d,target=/data",
        "--mount",
        "type=bind,source=/srv/c,target=/cache",
        "--env",
        "EAGLE_RUN_ID=r1",
        "--env",
        "HF_HOME=/cache/hf",
        "--env",
        "HOME=/cache/home",
        "--env",
        "TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor",
        "--env",
        "VLLM_CACHE_ROOT=/cache/vllm",
        "--env",
        "USER=eagle-stage",
        "--mount",
        "type=bind,source=/srv/m,target=/model,readonly",
        "--gpus",
        "all",
        "--entrypoint",
        "/bin/sh",
        "img:1",
        "-c",
        (
            "python -m pipeline extract --prepared /data/prepared --model /model "
            "--out /data/hidden_states --no-progress"
        ),
    )
    assert plan.host_inputs == ("/srv/d/prepared",) and plan.host_output == "/srv/d/hidden_states"
    assert "--privileged" not in plan.docker_run and plan.env_dir is None


def test_privilege_options_and_user_resolution():
    """The hosts-file options reach the argv; `auto` becomes the data root's owner, an explicit user stays."""
    plan = plan_stage(
        host(stage_user="root", stage_read_only=False, stage_pids_limit=0, stage_ipc="host"),
        "verify",
        run_id="r5",
    )
    argv = plan.docker_run
    assert (
        argv[argv.index("--user") + 1] == "0:0" and "--read-only" not in argv and "--pids-limit" not in argv
    )
    assert argv[argv.index("--ipc") + 1] == "host" and "--shm-size" not in argv
    assert resolve_user(host(), plan, 1000, 1000) == plan
    auto = resolve_user(host(), plan_stage(host(), "verify", run_id="r6"), 1000, 100)
    assert auto.docker_run[auto.docker_run.index("--user") + 1] == "1000:100" and auto.user == "1000:100"
    assert auto.preflight_run[auto.preflight_run.index("--user") + 1] == "1000:100"
    fixed = plan_stage(host(stage_user="4242:7"), "verify", run_id="r7")
    assert resolve_user(host(stage_user="4242:7"), fixed, 0, 0).docker_run == fixed.docker_run
    assert "4242:7" in fixed.docker_run


def test_secrets_travel_as_names_and_an_env_file_only():
    """With secrets, the argv carries --env-file in a per-run directory and no value; the start command
    makes the directory private before writing, reads the values from stdin, and removes it on any exit."""
    env = {"HF_TOKEN": "hf_canary_value_123", "FOO_API_KEY": "foo-canary-456"}
    names = available(("HF_TOKEN", "FOO_API_KEY", "UNSET_TOKEN"), env)
    assert names == ("HF_TOKEN", "FOO_API_KEY")
    plan = plan_stage(
        host(secrets_dir="/dev/shm"), "verify", run_id="r8", secret_names=names, env_token="abcd"
    )
    assert plan.env_dir == "/dev/shm/eagle-ops-r8-abcd"
    assert plan.docker_run[plan.docker_run.index("--env-file") + 1] == "/dev/shm/eagle-ops-r8-abcd/env"
    cmd = start_command(plan.docker_run, plan.env_dir)
    assert cmd.index("umask 077") < cmd.index("mkdir") < cmd.index("cat >") < cmd.index("docker run")
    assert "trap 'rm -rf -- \"$D\"' EXIT HUP INT TERM" in cmd
    text = env_file_text(names, env)
    assert text == "HF_TOKEN=hf_canary_value_123\nFOO_API_KEY=foo-canary-456\n# end of eagle-ops secrets\n"
    assert cmd.index("cat >") < cmd.index("tail -n 1") < cmd.index("docker run")
    for value in env.values():
        assert value not in cmd and value not in " ".join(plan.docker_run)
        assert value not in redact(f"token {value} in a line")
    assert "HF_TOKEN" in redact("HF_TOKEN=hf_canary_value_123") and redact("abc") == "abc"


def test_secret_values_docker_cannot_carry_are_refused_by_name():
    """A value with a newline is refused; the message names the variable, not the value."""
    with pytest.raises(ConfigError) as err:
        env_file_text(("BAR_TOKEN",), {"BAR_TOKEN": "line1\nline2-secret"})
    assert "BAR_TOKEN" in str(err.value) and "secret" in str(err.value) and "line2" not in str(err.value)


def test_redacting_writer_catches_a_value_split_across_chunks():
    """Streamed stage output is redacted line by line, also when a value arrives in two pieces."""
    import io

    protect(["split-canary-789"])
    sink = io.StringIO()
    w = RedactingWriter(sink)
    w.write("start split-can")
    w.write("ary-789 end\nlast line no newline split-canary-789")
    assert sink.getvalue() == "start [redacted] end\n"
    w.close()
    assert sink.getvalue() == "start [redacted] end\nlast line no newline [redacted]"


def test_resume_extra_args_and_verify_after():
    """--resume and extra args reach the stage command; stages other than extract/verify verify after."""
    plan = plan_stage(host(docker_gpus=""), "extract", run_id="r2", resume=True, extra_args=("--limit", "5"))
    assert plan.stage_argv[-3:] == ("--resume", "--limit", "5") and "--gpus" not in plan.docker_run
    weights = plan_stage(host(), "weights", run_id="r3")
    assert weights.docker_run[-1] == (
        "python -m pipeline weights --model /model --out /data/verifier && "
        "python -m pipeline verify /data/verifier"
    )


def test_hostile_paths_stay_data():
    """A data root with spaces, quotes, commas and $(...) becomes one CSV-quoted --mount field and one
    shell word; nothing of it is left for a shell to interpret."""
    evil = "/srv/a b,'c' \"d\" $(touch x)"
    plan = plan_stage(host(data_root=evil), "prepare", run_id="r4")
    mount = plan.docker_run[plan.docker_run.index("--mount") + 1]
    assert next(csv.reader([mount])) == [
        "type=bind",
        f"source={evil}",
        "target=/data",
    ]  # how docker parses it
    assert shlex.split(shlex.join(plan.docker_run)) == list(plan.docker_run)


@pytest.mark.parametrize("bad", ["", "a b", "x;y", "$(id)", "a" * 101])
def test_bad_run_ids(bad):
    """Run ids are names, not shell text."""
    with pytest.raises(ConfigError):
        plan_stage(host(), "extract", run_id=bad)


def test_agent_requests():
    """The agent is one fixed command line; what to do travels as JSON on stdin."""
    h = host(python="/usr/bin/python3", device_glob="/dev/nvidia*")
    assert command(h).startswith("/usr/bin/python3 -c ")
    assert probe_request(h) == {
        "op": "probe",
        "device_glob": "/dev/nvidia*",
        "gpu_source": "nvml",
        "server": {"kind": "none", "target": ""},
        "client": client_identity(),  # a pid file pointing at this ops process is told as such
        "spare_ssh_session": not h.is_local,
    }
    assert terminate_request([(5, 77)], [9], grace=1, kill_wait=2) == {
        "op": "terminate",
        "targets": [{"pid": 5, "starttime": 77}],
        "groups": [9],
        "grace": 1,
        "kill_wait": 2,
        "client": client_identity(),  # this ops process: never signalled, nor anything under it
    }
    assert client_identity()["pid"] == os.getpid() and client_identity()["boot_id"]


def test_start_command_runs_only_with_a_whole_env_file_and_always_removes_it(tmp_path):
    """Run by a real shell: a whole env file (0600 in a 0700 directory) reaches the command, which runs;
    a cut one (connection lost mid-transfer) runs nothing; an existing directory is never reused; the
    directory is gone afterwards in every case."""
    from ops.connection import LocalRunner

    env = {"HF_TOKEN": "hf_canary_value_123"}
    probe = ("sh", "-c", 'stat -c "%a" "$0" "$1"; cat "$1"', str(tmp_path / "d"), str(tmp_path / "d" / "env"))
    runner = LocalRunner()
    whole = runner.run(start_command(probe, str(tmp_path / "d")), stdin=env_file_text(("HF_TOKEN",), env))
    assert whole.ok and whole.stdout.splitlines()[:3] == ["700", "600", "HF_TOKEN=hf_canary_value_123"]
    cut = runner.run(start_command(probe, str(tmp_path / "d")), stdin="HF_TOKEN=hf_canary_va")
    assert not cut.ok and cut.stdout == ""
    assert not (tmp_path / "d").exists()
    (tmp_path / "d").mkdir()
    taken = runner.run(start_command(probe, str(tmp_path / "d")), stdin=env_file_text(("HF_TOKEN",), env))
    assert taken.exit_code == 125 and "File exists" in taken.stderr and (tmp_path / "d").is_dir()


def test_disk_check_follows_dtype_and_host_share():
    """The extract disk estimate uses 4 bytes for --dtype float32 and a 1/N share for --world-size N."""
    from ops.preflight import _disk_check

    meta, config = {"num_tokens": 1000, "num_samples": 10}, {"hidden_size": 256}
    bf16 = 1000 * (256 * 4 * 2 + 16) + 10 * 2048
    assert f"need {bf16 / 2**30:.3f} GiB" in _disk_check(meta, config, bf16).detail
    assert _disk_check(meta, config, bf16).status != _disk_check(meta, config, bf16, "float32").status
    half = _disk_check(meta, config, bf16 // 2, "bfloat16", 2)
    assert half.status == _disk_check(meta, config, bf16).status and "/ 2 hosts" in half.detail


def _state(driver):
    from ops.gpus import GpuState, ServerFacts

    return GpuState(
        host="box",
        hostname="box",
        gpus=(),
        holders=(),
        device_files=(),
        gpu_error=None,
        fuser_error=None,
        server=ServerFacts("none"),
        ancestry=(),
        driver=driver,
    )


@pytest.mark.parametrize(
    ("driver", "need", "status"),
    [
        ("580.65.06", "580", "ok"),
        ("590.1", "580", "ok"),
        ("570.86.15", "580", "fail"),
        ("table", "580", "warn"),
        (None, "580", "warn"),
        ("570.86.15", None, "ok"),
    ],
)
def test_driver_check_against_the_image_requirement(driver, need, status):
    """The host driver's major version against the image's eagle-ops.min-driver label: older fails naming
    both, unknown warns, an image without the label requires nothing."""
    from ops.preflight import driver_check

    res = driver_check(_state(driver), need)
    assert res.status == status, res
    if status == "fail":
        assert driver in res.detail and ">= 580" in res.detail


def test_plan_fields_render_the_argv_and_survive_a_replan():
    """User and image digest are plan fields: the digest reaches the stage container (not its preflight),
    a later layout keeps both, and an unknown digest changes nothing."""
    from contract.env import IMAGE_DIGEST_ENV
    from ops.layout import Layout
    from ops.stage import with_image_digest, with_layout

    h = host()
    plan = resolve_user(h, plan_stage(h, "extract", run_id="r8"), 1000, 100)
    assert with_image_digest(h, plan, None) == plan
    digest = "repo/img@sha256:" + "ab" * 32
    stamped = with_image_digest(h, plan, digest)
    env = f"{IMAGE_DIGEST_ENV}={digest}"
    assert stamped.image_digest == digest and env in stamped.docker_run and env not in stamped.preflight_run
    assert stamped.docker_run[stamped.docker_run.index(env) + 1] == h.image
    again = with_layout(h, stamped, Layout("hf", 1, 2))
    assert env in again.docker_run and again.user == "1000:100" and "--data-parallel" in again.stage_argv
    assert again.docker_run[again.docker_run.index("--user") + 1] == "1000:100"


def test_one_inventory_of_stage_containers():
    """One `docker ps` lists every stage container (all states, full ids) with the labels ops reads; a run id
    narrows it; lines of another shape are skipped."""
    from ops.inventory import inventory_argv, parse_inventory

    argv = inventory_argv()
    assert argv[:4] == ("docker", "ps", "--all", "--no-trunc") and "label=eagle-ops.run-id" in argv
    assert "label=eagle-ops.run-id=r9" in inventory_argv("r9")
    line = "\t".join(["f" * 64, "eagle-r9", "running", "r9", "extract", "/data/eagle/hidden_states", "box"])
    found = parse_inventory(f"{line}\nnot a container line\n")
    assert len(found) == 1 and found[0].running and found[0].output == "/data/eagle/hidden_states"
    assert found[0].id == "f" * 64 and found[0].run_id == "r9" and found[0].stage == "extract"
