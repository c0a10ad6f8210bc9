"""The host lock against real concurrent ops processes over a real sshd: a second command refuses or
waits; a killed or frozen first command does not block the host for ever; a stage container whose
ops process vanished blocks a duplicate run and is attached instead."""

from __future__ import annotations

import json
import signal

import pytest

from ops_helpers import OpsProcess, lock_is_free, lock_record, run_ops, ssh_table, write_hosts
from ops_procs import alive, wait_for, write_gpu_table
from test_ops_remote_run import assets, dk, image, ops, scene  # noqa: F401  (module fixtures, a scene of its own)

pytestmark = pytest.mark.sshd

FAST = {"grace": 1, "kill_wait": 2, "stop": 3, "clean": 3}
PAUSE = "EAGLE_OPS_PAUSE_AT"


@pytest.fixture
def box(tmp_path, sshd, devdir, procs):
    """A host with an orphan GPU holder and no server; its lock file in the test folder."""
    orphan = procs.holder([devdir / "nvidia0"], name="orphan")
    table = write_gpu_table(tmp_path / "gpus.json", [{"processes": [{"pid": orphan.pid, "used_mib": 10}]}])
    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    hosts = write_hosts(
        tmp_path / "hosts.toml",
        "box",
        **ssh_table(
            sshd,
            known,
            device_glob=f"{devdir}/nvidia*",
            gpu_source=f"table:{table}",
            timeouts={**FAST, "lock_expire": 2},
        ),
    )
    return dict(tmp=tmp_path, hosts=hosts, lock=tmp_path / "eagle-ops.lock", orphan=orphan)


def background(box, name: str, *args: str, pause: str | None = None) -> OpsProcess:
    return OpsProcess(
        box["tmp"],
        name,
        *args,
        "--host",
        "box",
        "--hosts-file",
        str(box["hosts"]),
        env={PAUSE: pause} if pause else None,
    )


def test_second_gpu_clean_refuses_naming_the_holder_then_waits(box):
    """While one gpu-clean holds the host, a second refuses with one line naming command, operator and
    start time (exit 9) and touches nothing; with --wait it waits and then succeeds."""
    first = background(box, "first", "gpu-clean", pause="locked")
    try:
        first.wait_for("paused at locked")
        holder = lock_record(box["lock"])
        assert holder["command"] == "gpu-clean" and alive(holder["pid"])
        second = background(box, "second", "gpu-clean")
        assert second.finish() == 9, second.text()
        line = second.err.read_text().strip()
        assert line.splitlines() == [line] and line.startswith("error: box is busy: gpu-clean by "), line
        assert f"since {holder['since']} (lock pid {holder['pid']})" in line and "--wait SECONDS" in line
        assert box["orphan"].poll() is None  # the refused command signalled nothing
        waiter = background(box, "waiter", "gpu-clean", "--wait", "120")
        waiter.wait_for("is busy: gpu-clean by")
        first.proc.send_signal(signal.SIGUSR1)  # let the first one go on
        assert first.finish() == 0, first.text()
        assert waiter.finish() == 0, waiter.text()
        assert "clean (nothing to do)" in waiter.text()  # the first one already freed the GPU
        assert not alive(box["orphan"].pid) and lock_is_free(box["lock"])
    finally:
        first.kill()


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_dead_or_frozen_holder_does_not_block_the_host(box, how):
    """The lock of a gpu-clean that is SIGKILLed (its SSH connection closes) is free at once; the lock of
    one that is frozen (SIGSTOP: its connection stays open) is released after timeouts.lock_expire, so
    a waiting gpu-clean succeeds; the first one's keeper process is gone."""
    first = background(box, "first", "gpu-clean", pause="locked")
    try:
        first.wait_for("paused at locked")
        keeper = lock_record(box["lock"])["pid"]
        if how == "killed":
            first.kill()
            wait_for(lambda: lock_is_free(box["lock"]), timeout=60)
        else:
            first.proc.send_signal(signal.SIGSTOP)
        second = background(box, "second", "gpu-clean", "--wait", "120")
        assert second.finish() == 0, second.text()
        wait_for(lambda: not alive(keeper), timeout=60)
        assert lock_record(box["lock"]) is None  # released cleanly by the second one
    finally:
        first.proc.send_signal(signal.SIGCONT)
        first.kill()


@pytest.mark.slow
def test_dropped_remote_extract_keeps_its_stage_and_blocks_a_duplicate(scene, dk):  # noqa: F811
    """A remote-extract whose ops process is SIGKILLed while following: the lock is freed, the stage
    container runs on; a second remote-extract is first refused by the lock (exit 9, naming the run),
    then, after the kill, by the stage container of the same output (exit 9, pointing to attach);
    attach follows the stage to its end and collects it."""
    runs = str(scene["runs"])
    lock = scene["hosts"].parent / "eagle-ops.lock"
    hosts = scene["hosts"].read_text()
    assert f'lock_file = "{lock}"' in hosts
    first = OpsProcess(
        scene["tmp"],
        "drop-first",
        "remote-extract",
        "--run-id",
        "dup1",
        "--resume",
        "--host",
        "box",
        "--hosts-file",
        str(scene["hosts"]),
        "--runs-dir",
        runs,
        env={PAUSE: "follow"},
    )
    try:
        first.wait_for("paused at follow")
        res = ops(scene, "remote-extract", "--run-id", "dup2", "--resume", "--runs-dir", runs)
        assert res.returncode == 9 and "box is busy: remote-run extract (run dup1) by " in res.stderr, (
            res.stderr
        )
        first.kill()  # the laptop vanishes mid-run
        wait_for(lambda: lock_is_free(lock), timeout=60)
        assert dk.containers.get("eagle-dup1").status in ("running", "exited")
        res = ops(scene, "remote-extract", "--run-id", "dup3", "--resume", "--runs-dir", runs)
        assert res.returncode == 9, res.stdout + res.stderr
        assert (
            "hidden_states on box is " in res.stderr
            and "run dup1 (container eagle-dup1); `attach dup1`" in res.stderr
        )
        assert not dk.containers.list(all=True, filters={"label": "eagle-ops.run-id=dup3"})
        res = ops(scene, "attach", "dup1", "--runs-dir", runs)
        assert res.returncode == 0, res.stdout + res.stderr
        assert json.loads((scene["runs"] / "box" / "dup1" / "summary.json").read_text())["checks"]
        assert not dk.containers.list(all=True, filters={"label": "eagle-ops.run-id=dup1"})
        state = json.loads((scene["runs"] / "box" / "dup1" / "state.json").read_text())
        assert (state["status"], state["step"], state["exit_code"]) == (
            "done",
            "fetch",
            0,
        )  # attach finished it
        assert [s["step"] for s in state["steps"]][-4:] == ["follow", "attach", "follow", "fetch"]
    finally:
        first.kill()


@pytest.mark.docker
def test_gpu_clean_does_not_kill_a_stage_that_holds_gpus(box, devdir):
    """A stage container left running (detached, or its ops process gone) that holds a GPU device file is
    not killed by gpu-clean as an orphan: exit 9 naming the run and `attach`; it and the orphan live on."""
    from ops_docker import client, ensure_base_image, holder_container, remove_test_containers, unique

    dk = client()  # noqa: F811 (its own client, not the module's fixture)
    ensure_base_image()
    name = unique("eagle-ops-test-stage")
    try:
        stage = holder_container(dk, name, devdir, [devdir / "nvidia1"], labels={"eagle-ops.run-id": "left1"})
        res = run_ops("gpu-clean", "--host", "box", "--hosts-file", str(box["hosts"]))
        assert res.returncode == 9, res.stdout + res.stderr
        assert res.stderr.strip() == (
            f"error: stage run left1 (container {name}) holds GPUs on box; `attach left1` "
            f"to follow it, or `docker stop {name}` first; nothing was stopped or signalled"
        )
        stage.reload()
        assert stage.status == "running" and box["orphan"].poll() is None
    finally:
        remove_test_containers(dk, [name])
