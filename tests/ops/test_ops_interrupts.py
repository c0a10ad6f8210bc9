"""Ctrl-C (a real SIGINT) at every step of a real remote-extract over a real sshd and dockerd, and
--detach: what is left behind and what state.json says. The process is paused at the step by the
documented seam EAGLE_OPS_PAUSE_AT, so every step is hit deterministically."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from ops.runstate import STEPS
from ops_docker import unique
from ops_helpers import OpsProcess, lock_is_free, lock_record, run_ops
from ops_procs import alive, wait_for
from test_ops_remote_run import assets, dk, image, ops, scene  # noqa: F401  (module fixtures, a scene of its own)

pytestmark = [pytest.mark.sshd, pytest.mark.docker, pytest.mark.slow]


def _sessions(sshd) -> list[str]:
    return subprocess.run(["pgrep", "-P", str(sshd.proc.pid)], capture_output=True, text=True).stdout.split()


@pytest.mark.parametrize("step", STEPS)
def test_ctrl_c_at_every_step_leaves_nothing_behind(scene, dk, sshd, step):  # noqa: F811
    """SIGINT at STEP: exit 130; the server runs again (--restore-server); no stage container, no ops
    process on the host (log follower, lock keeper, SSH session) is left; the lock is free; state.json
    says interrupted at STEP."""
    assert ops(scene, "restore-server").returncode == 0
    sessions = set(_sessions(sshd))  # SSH sessions of other tests' commands that are still closing
    rid = f"int-{step}"
    lock = scene["hosts"].parent / "eagle-ops.lock"
    proc = OpsProcess(
        scene["tmp"],
        rid,
        "remote-extract",
        "--run-id",
        rid,
        "--resume",
        "--restore-server",
        "--host",
        "box",
        "--hosts-file",
        str(scene["hosts"]),
        "--runs-dir",
        str(scene["runs"]),
        env={"EAGLE_OPS_PAUSE_AT": step},
    )
    try:
        proc.wait_for(f"paused at {step}")
        state_file = scene["runs"] / "box" / rid / "state.json"
        assert json.loads(state_file.read_text())["step"] == step
        keeper = None if step in ("connect", "lock") else lock_record(lock)["pid"]
        proc.proc.send_signal(signal.SIGINT)
        assert proc.finish() == 130, proc.text()
    finally:
        proc.kill()
    state = json.loads(state_file.read_text())
    assert (state["status"], state["step"]) == ("interrupted", step), state
    assert [s["step"] for s in state["steps"]] == list(STEPS[: STEPS.index(step) + 1])
    scene["server"].reload()
    assert scene["server"].status == "running", proc.text()
    assert not dk.containers.list(all=True, filters={"label": f"eagle-ops.run-id={rid}"})
    assert lock_is_free(lock)
    if keeper is not None:
        wait_for(lambda: not alive(keeper), timeout=60)
    wait_for(
        lambda: not subprocess.run(["pgrep", "-f", f"eagle-{rid}"], capture_output=True).stdout, timeout=60
    )
    wait_for(lambda: set(_sessions(sshd)) <= sessions, timeout=60)
    if step in ("start", "follow"):
        assert state["container_removed"] is True and (scene["runs"] / "box" / rid / "stage.log").exists()


def test_detach_leaves_the_stage_running_and_attach_collects_it(scene, dk):  # noqa: F811
    """--detach starts the stage and returns 0 with state.json `detached`; attach --restore-server
    follows it, collects it and brings the server back; --detach with --restore-server is refused."""
    res = ops(
        scene,
        "remote-extract",
        "--run-id",
        "det0",
        "--resume",
        "--detach",
        "--restore-server",
        "--runs-dir",
        str(scene["runs"]),
    )
    assert res.returncode == 2 and "pass --restore-server to `attach` instead" in res.stderr, res.stderr
    assert ops(scene, "restore-server").returncode == 0
    res = ops(
        scene, "remote-extract", "--run-id", "det1", "--resume", "--detach", "--runs-dir", str(scene["runs"])
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "detached: eagle-det1 runs on; `attach det1`" in res.stdout
    state = json.loads((scene["runs"] / "box" / "det1" / "state.json").read_text())
    assert (state["status"], state["step"], state["container"]) == ("detached", "start", "eagle-det1")
    assert dk.containers.get("eagle-det1").status in ("running", "exited")
    scene["server"].reload()
    assert scene["server"].status == "exited"  # the stage has the GPUs
    res = ops(scene, "attach", "det1", "--restore-server", "--runs-dir", str(scene["runs"]))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "restored: start server" in res.stdout
    scene["server"].reload()
    assert scene["server"].status == "running"
    assert not dk.containers.list(all=True, filters={"label": "eagle-ops.run-id=det1"})


def _stand_in_stage(dk, img: str, name: str, scene: dict):  # noqa: F811 (its own, not the fixtures)
    """A container labelled as another run's stage (as a detached run or one started by hand would be)."""
    return dk.containers.run(
        img,
        ["sleep", "600"],
        name=name,
        detach=True,
        labels={
            "eagle-ops.run-id": name,
            "eagle-ops.stage": "extract",
            "eagle-ops.host": "box",
            "eagle-ops.output": f"{scene['data']}/elsewhere",
        },
    )


def _refusal(name: str) -> str:
    return (
        f"error: stage run {name} (container {name}) is running on box; the server would start beside "
        f"it: `attach {name} --restore-server` brings it back once the stage ends; nothing was started"
    )


def test_no_restore_beside_a_running_stage_and_attach_restores_under_the_lock(scene, dk, image):  # noqa: F811
    """While a stage container runs (here another run's, started behind ops's back), restore-server and
    attach --restore-server refuse (exit 9, one line naming it) and start nothing; attach still collects
    its own run. attach's restore waits for the host lock like the other changing commands: refused while
    another command holds it. Once the stage is gone, restore-server brings the server back."""
    assert ops(scene, "restore-server").returncode == 0
    res = ops(
        scene, "remote-extract", "--run-id", "det2", "--resume", "--detach", "--runs-dir", str(scene["runs"])
    )
    assert res.returncode == 0, res.stdout + res.stderr
    img, _ = image
    name = unique("eagle-other-stage")  # other checkouts test on the same engine
    other = _stand_in_stage(dk, img, name, scene)
    lock = scene["hosts"].parent / "eagle-ops.lock"
    holder = None
    try:
        refusal = _refusal(name)
        res = ops(scene, "restore-server")
        assert (res.returncode, res.stderr.strip()) == (9, refusal), res.stdout + res.stderr
        res = ops(scene, "attach", "det2", "--restore-server", "--runs-dir", str(scene["runs"]))
        assert (res.returncode, res.stderr.strip()) == (9, refusal), res.stdout + res.stderr
        assert (scene["runs"] / "box" / "det2" / "summary.json").exists()  # collected all the same
        assert not dk.containers.list(all=True, filters={"label": "eagle-ops.run-id=det2"})
        scene["server"].reload()
        assert scene["server"].status == "exited"
        other.remove(force=True)
        res = ops(
            scene,
            "remote-extract",
            "--run-id",
            "det3",
            "--resume",
            "--detach",
            "--runs-dir",
            str(scene["runs"]),
        )
        assert res.returncode == 0, res.stdout + res.stderr
        holder = OpsProcess(
            scene["tmp"],
            "holder",
            "stop-server",
            "--host",
            "box",
            "--hosts-file",
            str(scene["hosts"]),
            env={"EAGLE_OPS_PAUSE_AT": "locked"},
        )
        holder.wait_for("paused at locked")
        res = ops(scene, "attach", "det3", "--restore-server", "--runs-dir", str(scene["runs"]))
        assert res.returncode == 9 and res.stderr.startswith("error: box is busy: stop-server"), (
            res.stdout + res.stderr
        )
        assert not dk.containers.list(all=True, filters={"label": "eagle-ops.run-id=det3"})
        scene["server"].reload()
        assert scene["server"].status == "exited"
        holder.kill()
        wait_for(lambda: lock_is_free(lock), timeout=60)
    finally:
        if holder is not None:
            holder.kill()
        try:
            other.remove(force=True)
        except Exception:  # noqa: BLE001 - removed above
            pass
    res = ops(scene, "restore-server")
    assert res.returncode == 0 and "start server" in res.stdout, res.stdout + res.stderr
    scene["server"].reload()
    assert scene["server"].status == "running"


def test_a_runs_own_restore_refuses_beside_a_stage_started_meanwhile(scene, dk, image):  # noqa: F811
    """remote-extract --restore-server, paused at its restore step while a stage container is started behind
    ops's back: the run's result stands (summary fetched, container collected) but the server stays down,
    exit 9 with the one-line refusal, state.json `failed` with it. Its preflight could not have seen it."""
    assert ops(scene, "restore-server").returncode == 0
    img, _ = image
    name = unique("eagle-late-stage")
    proc = OpsProcess(
        scene["tmp"],
        "late",
        "remote-extract",
        "--run-id",
        "late1",
        "--resume",
        "--restore-server",
        "--host",
        "box",
        "--hosts-file",
        str(scene["hosts"]),
        "--runs-dir",
        str(scene["runs"]),
        env={"EAGLE_OPS_PAUSE_AT": "restore"},
    )
    other = None
    try:
        proc.wait_for("paused at restore")
        other = _stand_in_stage(dk, img, name, scene)
        proc.proc.send_signal(signal.SIGUSR1)
        assert proc.finish() == 9, proc.text()
        refusal = _refusal(name)
        assert proc.err.read_text().strip().splitlines()[-1] == refusal
        assert (scene["runs"] / "box" / "late1" / "summary.json").exists()
        assert not dk.containers.list(all=True, filters={"label": "eagle-ops.run-id=late1"})
        state = json.loads((scene["runs"] / "box" / "late1" / "state.json").read_text())
        assert (state["status"], "error: " + state["error"]) == ("failed", refusal)
        scene["server"].reload()
        assert scene["server"].status == "exited"
    finally:
        proc.kill()
        if other is not None:
            other.remove(force=True)
    res = ops(scene, "restore-server")
    assert res.returncode == 0 and "start server" in res.stdout, res.stdout + res.stderr


def test_server_stop_failure_ends_the_run_at_stop_server(scene, dk, tmp_path):  # noqa: F811
    """remote-extract with a server name that matches no container: exit 7 with one line, no stage
    container, state.json `failed` at stop-server with that line."""
    assert ops(scene, "restore-server").returncode == 0
    bad = tmp_path / "hosts.toml"
    bad.write_text(
        scene["hosts"].read_text().replace(f"container:{scene['name']}", "container:ops-test-typo")
    )
    res = run_ops(
        "remote-extract",
        "--run-id",
        "stopfail",
        "--resume",
        "--restore-server",
        "--host",
        "box",
        "--hosts-file",
        str(bad),
        "--runs-dir",
        str(scene["runs"]),
    )
    assert res.returncode == 7, res.stdout + res.stderr
    line = res.stderr.strip()
    assert (
        line == "error: server container ops-test-typo does not exist on box; fix `server` in the hosts file "
        "(`none` if there is no server); nothing was stopped or signalled"
    )
    state = json.loads((scene["runs"] / "box" / "stopfail" / "state.json").read_text())
    assert (state["status"], state["step"], "error: " + state["error"]) == ("failed", "stop-server", line)
    assert not dk.containers.list(all=True, filters={"label": "eagle-ops.run-id=stopfail"})
    scene["server"].reload()
    assert scene["server"].status == "running"
