"""gpu-status and gpu-clean against real processes holding files in a temporary device directory,
over a real sshd; the NVML part is a table of the same real pids (gpu_source = table:PATH)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ops_helpers import run_ops, ssh_table, write_hosts
from ops_procs import Freezer, alive, write_gpu_table

pytestmark = pytest.mark.sshd

FAST = {"grace": 1, "kill_wait": 2, "stop": 5, "clean": 3}


@pytest.fixture
def scene(tmp_path, devdir, procs, sshd):
    """A pid-file server (API + engine child), an orphan, a TERM-ignoring orphan, a protected daemon, and
    a bystander holding a file outside the device glob."""
    d0, d1, ctl = devdir / "nvidia0", devdir / "nvidia1", devdir / "nvidiactl"
    api, engine = procs.server(tmp_path / "server.pid", [d0, ctl])
    orphan = procs.holder([d0, ctl], name="python-orphan")
    stubborn = procs.holder([d1, ctl], name="stubborn", ignore_term=True)
    daemon = procs.renamed_binary("nvidia-persistenced", [ctl])
    bystander = procs.holder([devdir / "unrelated"], name="bystander")
    table = write_gpu_table(
        tmp_path / "gpus.json",
        [
            {
                "name": "Table H200",
                "memory_total_mib": 143771,
                "base_used_mib": 618,
                "processes": [{"pid": engine, "used_mib": 70000}, {"pid": orphan.pid, "used_mib": 2000}],
            },
            {
                "name": "Table H200",
                "memory_total_mib": 143771,
                "base_used_mib": 0,
                "processes": [{"pid": stubborn.pid, "used_mib": 1000}],
            },
        ],
    )
    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    hosts = write_hosts(
        tmp_path / "hosts.toml",
        "box",
        **ssh_table(
            sshd,
            known,
            server=f"pidfile:{tmp_path / 'server.pid'}",
            device_glob=f"{devdir}/nvidia*",
            gpu_source=f"table:{table}",
            timeouts=FAST,
        ),
    )
    return dict(
        api=api,
        engine=engine,
        orphan=orphan,
        stubborn=stubborn,
        daemon=daemon,
        bystander=bystander,
        hosts=hosts,
        table=table,
    )


def ops(scene, *args):
    return run_ops(*args, "--host", "box", "--hosts-file", str(scene["hosts"]))


def test_gpu_status_json_classifies_every_holder(scene):
    """Every holder is listed with its class: the server's engine, two orphans, the protected daemon."""
    res = ops(scene, "gpu-status", "--json")
    assert res.returncode == 0, res.stderr
    state = json.loads(res.stdout)
    klass = {h["proc"]["pid"]: h["klass"] for h in state["holders"]}
    assert klass == {
        scene["engine"]: "server",
        scene["orphan"].pid: "orphan",
        scene["stubborn"].pid: "orphan",
        scene["daemon"].pid: "protected",
    }
    assert [g["memory_used_mib"] for g in state["gpus"]] == [618 + 72000, 1000]
    engine = next(h for h in state["holders"] if h["proc"]["pid"] == scene["engine"])
    assert (
        engine["proc"]["comm"] == "VLLM::EngineCor"
        and engine["gpus"] == [0]
        and engine["via"] == "fuser+nvml"
    )


def test_gpu_status_table(scene):
    """The human table shows each GPU's memory and each process with PID, name and class."""
    res = ops(scene, "gpu-status")
    assert res.returncode == 0, res.stderr
    assert "GPU 0 Table H200: 72618/143771 MiB" in res.stdout
    for pid, cls in (
        (scene["engine"], "server"),
        (scene["orphan"].pid, "orphan"),
        (scene["daemon"].pid, "protected"),
    ):
        assert any(str(pid) in line and cls in line for line in res.stdout.splitlines()), (pid, res.stdout)


def test_dry_run_prints_the_plan_and_touches_nothing(scene):
    """--dry-run names what would be stopped and signalled, and every process is still alive after."""
    res = ops(scene, "gpu-clean", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "stop server process group" in res.stdout and "dry run" in res.stdout
    for pid in (scene["orphan"].pid, scene["stubborn"].pid):
        assert str(pid) in res.stdout
    assert f"spare {scene['daemon'].pid} nvidia-persiste" in res.stdout
    for p in ("api", "orphan", "stubborn", "daemon", "bystander"):
        assert scene[p].poll() is None, p
    assert alive(scene["engine"])


def test_gpu_clean_kills_exactly_the_holders_then_is_a_noop(scene):
    """The server group is stopped, both orphans die (the TERM-ignorer by KILL), the protected daemon and
    the bystander live, the GPUs verify clean; a second run right after does nothing."""
    res = ops(scene, "gpu-clean")
    assert res.returncode == 0, res.stdout + res.stderr
    for p in ("api", "orphan", "stubborn"):
        assert not alive(scene[p].pid), p
    assert not alive(scene["engine"])
    assert scene["daemon"].poll() is None and scene["bystander"].poll() is None
    assert f"signalled {scene['stubborn'].pid} stubborn: TERM then KILL" in res.stdout
    assert f"signalled {scene['orphan'].pid} python-orphan: TERM\n" in res.stdout
    assert "GPU 0: ok" in res.stdout and "GPU 1: ok" in res.stdout
    again = ops(scene, "gpu-clean")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "clean (nothing to do)" in again.stdout and "signalled" not in again.stdout
    assert scene["daemon"].poll() is None


def test_frozen_holder_is_unkillable_reboot_needed(scene, procs, devdir):
    """A holder that survives SIGKILL (frozen, D state) is reported with pid and state, exit code 5."""
    hung = procs.holder([devdir / "nvidia1"], name="hung-worker")
    freezer = Freezer(f"eagle-ops-test-{os.getpid()}")
    try:
        freezer.freeze(hung.pid)
        res = ops(scene, "gpu-clean")
        assert res.returncode == 5, res.stdout + res.stderr
        assert f"unkillable: reboot needed: {hung.pid} hung-worker state D" in " ".join(res.stdout.split())
        assert scene["daemon"].poll() is None
        assert not alive(scene["orphan"].pid)
    finally:
        freezer.thaw_and_remove()


def test_memory_over_threshold_is_not_clean(scene, tmp_path):
    """With no process left but used memory over the threshold the verdict is 'not clean', exit 6."""
    write_gpu_table(scene["table"], [{"base_used_mib": 4096, "processes": []}])
    for p in ("api", "orphan", "stubborn"):
        scene[p].kill()
    os.kill(scene["engine"], 9)
    res = ops(scene, "gpu-clean")
    assert res.returncode == 6, res.stdout + res.stderr
    assert "4096 MiB used >= threshold 1024 MiB" in res.stdout


def test_local_mode_spares_our_own_ancestry(tmp_path, devdir, procs):
    """In local mode the shell that runs ops holds a device file: it and ops survive, the orphan dies."""
    orphan = procs.holder([devdir / "nvidia0"], name="orphan")
    table = write_gpu_table(tmp_path / "gpus.json", [{"processes": [{"pid": orphan.pid, "used_mib": 10}]}])
    hosts = write_hosts(
        tmp_path / "hosts.toml",
        "here",
        host="local",
        python="/usr/bin/python3",
        device_glob=f"{devdir}/nvidia*",
        gpu_source=f"table:{table}",
        timeouts=FAST,
        lock_file=str(tmp_path / "eagle-ops.lock"),
    )
    import subprocess
    import sys

    script = (
        f"exec 7<{devdir}/nvidia0; {sys.executable} -m ops gpu-clean --host here --hosts-file {hosts}; "
        "echo shell-survived rc=$?"
    )
    res = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        env=dict(os.environ, COLUMNS="200"),
        timeout=60,
    )
    assert "shell-survived rc=0" in res.stdout, res.stdout + res.stderr
    assert "our own ancestry" in res.stdout
    assert not alive(orphan.pid)


def test_nvml_path_without_a_driver_reports_and_refuses_to_call_clean(sshd, tmp_path, devdir):
    """With gpu_source nvml the real binding travels to the host; without a driver gpu-status says so and
    exits 6 (GPU facts unreadable: it was 0), and gpu-clean refuses at once in one line (exit 6: NVML that
    cannot load is not waited on), rather than declaring the GPUs clean."""
    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    hosts = write_hosts(
        tmp_path / "hosts.toml",
        "box",
        **ssh_table(sshd, known, device_glob=f"{devdir}/nvidia*", timeouts=FAST),
    )
    res = run_ops("gpu-status", "--host", "box", "--hosts-file", str(hosts))
    assert res.returncode == 6 and "GPU facts unavailable: NVML init failed" in res.stdout, (
        res.stdout + res.stderr
    )
    err = res.stderr.strip()
    assert err.startswith("error: cannot read the GPU facts of box: NVML init failed"), err
    assert "\n" not in err, err
    res = run_ops("gpu-clean", "--host", "box", "--hosts-file", str(hosts))
    err = res.stderr.strip()
    assert res.returncode == 6, res.stdout + res.stderr
    assert err.startswith("error: cannot read the GPU facts of box: NVML init failed"), err
    assert "\n" not in err and "nothing was stopped or signalled" in err, err


def _lone_host(sshd, tmp_path: Path, devdir: Path, table: Path, **extra) -> Path:
    known = sshd.write_known_hosts(tmp_path / "known_hosts")
    table_kw = ssh_table(
        sshd, known, device_glob=f"{devdir}/nvidia*", gpu_source=f"table:{table}", timeouts=FAST
    )
    table_kw.update(extra)
    return write_hosts(tmp_path / "hosts.toml", "box", **table_kw)


def test_respawned_holder_is_named_with_its_supervisor(tmp_path, devdir, procs, sshd):
    """A holder that its supervisor restarts after every kill (a new pid on the same device each time) is
    recognised: gpu-clean stops after its bounded kill rounds with verdict 'respawned by pid N (...)',
    exit 10, in bounded time by its own clock, and leaves the supervisor alive (nobody asked to kill it)."""
    from ops.clean import MAX_ROUNDS, RESPAWNED

    sup, first = procs.supervisor([devdir / "nvidia0"], name="respawned-wrk")
    table = write_gpu_table(tmp_path / "gpus.json", [{"processes": []}])
    hosts = _lone_host(sshd, tmp_path, devdir, table)
    res = run_ops("gpu-clean", "--json", "--host", "box", "--hosts-file", str(hosts))
    assert res.returncode == 10, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["verdict"] == RESPAWNED and report["rounds"] == MAX_ROUNDS
    assert [s["pid"] for s in report["supervisors"]] == [sup.pid] and report["detail"].startswith(
        f"pid {sup.pid} (supervisor: "
    )
    killed = [s["pid"] for s in report["signalled"]]
    back = [r["pid"] for r in report["respawned"]]
    assert killed[0] == first and len(killed) == MAX_ROUNDS and len(back) == MAX_ROUNDS
    assert len(set(killed + back)) == MAX_ROUNDS + 1  # a new pid each time (the last one was not killed)
    assert all(
        r["devices"] == [str(devdir / "nvidia0")] and r["ppid"] == sup.pid for r in report["respawned"]
    )
    assert report["elapsed_s"] < 60 and sup.poll() is None
    human = run_ops("gpu-clean", "--host", "box", "--hosts-file", str(hosts))
    assert human.returncode == 10, human.stdout + human.stderr
    assert f"respawned by a supervisor: pid {sup.pid} (supervisor: " in human.stdout
    assert f"{MAX_ROUNDS} kill round(s)" in human.stdout and sup.poll() is None


def test_holder_we_may_not_signal_is_reported_at_once(procs, sshd, tmp_path):
    """The host agent runs unprivileged (setpriv to nobody), the holder as root: SIGTERM fails with EPERM,
    the verdict is 'cannot signal: permission denied' naming pid and owner, exit 11, at once (the tool's
    own time well under the 60 s grace: no waiting, no SIGKILL retry), and the holder is untouched."""
    import shutil
    import tempfile

    from ops.clean import CANNOT_SIGNAL

    # everything the unprivileged agent reads must be world-readable (pytest's tmp dirs are root-only)
    pub = Path(tempfile.mkdtemp(prefix="eagle-ops-eperm-"))
    try:
        os.chmod(pub, 0o755)
        dev = pub / "dev"
        dev.mkdir(mode=0o755)
        (dev / "nvidia0").write_bytes(b"")
        holder = procs.holder([dev / "nvidia0"], name="root-holder")
        table = write_gpu_table(pub / "gpus.json", [{"processes": [{"pid": holder.pid, "used_mib": 100}]}])
        os.chmod(table, 0o644)
        wrapper = pub / "python-as-nobody"
        wrapper.write_text(
            '#!/bin/sh\nexec setpriv --reuid=65534 --regid=65534 --clear-groups /usr/bin/python3 "$@"\n'
        )
        os.chmod(wrapper, 0o755)
        slow = {"grace": 60, "kill_wait": 60, "stop": 5, "clean": 3}
        lock = pub / "eagle-ops.lock"  # the host lock is taken by the same unprivileged user
        lock.touch()
        os.chmod(lock, 0o666)
        hosts = _lone_host(
            sshd, tmp_path, dev, table, python=str(wrapper), timeouts=slow, lock_file=str(lock)
        )
        res = run_ops("gpu-clean", "--json", "--host", "box", "--hosts-file", str(hosts))
        assert res.returncode == 11, res.stdout + res.stderr
        report = json.loads(res.stdout)
        assert report["verdict"] == CANNOT_SIGNAL and report["signalled"] == [] and report["rounds"] == 1
        assert [(d["pid"], d["user"], d["signal"], d["as_uid"]) for d in report["denied"]] == [
            (holder.pid, "root", "TERM", 65534)
        ]
        assert report["elapsed_s"] < 30 and holder.poll() is None
        human = run_ops("gpu-clean", "--host", "box", "--hosts-file", str(hosts))
        assert human.returncode == 11, human.stdout + human.stderr
        text = " ".join(human.stdout.split())
        assert f"cannot signal: permission denied: pid {holder.pid} (root-holder, user root)" in text, text
        assert holder.poll() is None
    finally:
        shutil.rmtree(pub)
