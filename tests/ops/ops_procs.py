"""Real processes for the GPU-cleanup tests: device-file holders, a TERM-ignoring one, a protected name,
a pid-file server whose engine child keeps the process group after its API process dies, frozen ones."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HOLDER = r"""
import ctypes, os, signal, sys, time
name, ignore_term, files = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
if name:
    ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: what ps/comm show
# explicit handlers: as PID 1 of a container the default TERM action would be ignored
signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_term else (lambda *_: sys.exit(0)))
handles = [open(f, "rb") for f in files]
print("ready", flush=True)
while True:
    time.sleep(1)
"""

# The "API server": group leader, writes the pid file, starts an engine child that holds the GPU,
# and on SIGTERM stops the child and exits (like vLLM's graceful shutdown).
SERVER = r"""
import os, signal, subprocess, sys, time
pidfile, holder, files = sys.argv[1], sys.argv[2], sys.argv[3:]
child = subprocess.Popen([sys.executable, "-c", holder, "VLLM::EngineCore", "0", *files], stdout=subprocess.PIPE)
child.stdout.readline()
def stop(*_):
    child.terminate(); child.wait(); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
tmp = pidfile + ".tmp"
open(tmp, "w").write(str(os.getpid())); os.rename(tmp, pidfile)
print(child.pid, flush=True)
while True:
    time.sleep(1)
"""  # noqa: E501


# A supervisor (like a process manager or systemd's Restart=always): it starts a holder, and each time
# the holder dies starts a new one (a new pid) at once. It holds no device file itself.
SUPERVISOR = r"""
import ctypes, subprocess, sys, time
holder, name, files = sys.argv[1], sys.argv[2], sys.argv[3:]
ctypes.CDLL(None).prctl(15, b"supervisor", 0, 0, 0)
first = True
while True:
    child = subprocess.Popen([sys.executable, "-c", holder, name, "0", *files], stdout=subprocess.PIPE)
    child.stdout.readline()
    if first:
        print(child.pid, flush=True)
        first = False
    child.wait()
    time.sleep(0.05)
"""


class Procs:
    """Starts real processes and guarantees none outlives the test."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[subprocess.Popen] = []
        self.extra_pids: list[int] = []
        self.groups: list[int] = []  # process groups killed whole at cleanup

    def holder(
        self, files: list[Path], name: str = "", ignore_term: bool = False, exe: str | None = None, **popen
    ) -> subprocess.Popen:
        argv = [exe or sys.executable, "-c", HOLDER, name, "1" if ignore_term else "0", *map(str, files)]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **popen)
        self.started.append(p)
        assert p.stdout.readline().strip() == "ready"
        return p

    def renamed_binary(self, name: str, files: list[Path]) -> subprocess.Popen:
        """A real binary whose file name is `name` (argv0 and /proc comm), holding files via redirects."""
        exe = self.root / name
        shutil.copy("/bin/sleep", exe)
        opens = " ".join(f"{3 + i}<{_q(f)}" for i, f in enumerate(files))
        p = subprocess.Popen(["bash", "-c", f"exec {_q(exe)} 600 {opens}"])
        self.started.append(p)
        wait_for(lambda: os.readlink(f"/proc/{p.pid}/exe").endswith(name))
        return p

    def server(self, pidfile: Path, files: list[Path]) -> tuple[subprocess.Popen, int]:
        """(API process, engine child pid): a new session, so pgid == the API pid."""
        p = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(pidfile), HOLDER, *map(str, files)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.started.append(p)
        child = int(p.stdout.readline())
        self.extra_pids.append(child)
        wait_for(pidfile.exists)
        return p, child

    def supervisor(self, files: list[Path], name: str) -> tuple[subprocess.Popen, int]:
        """(supervisor, its first holder's pid): a new session, so cleanup kills the whole group."""
        script = self.root / "supervisor.py"
        script.write_text(SUPERVISOR)
        p = subprocess.Popen(
            [sys.executable, str(script), HOLDER, name, *map(str, files)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.started.append(p)
        self.groups.append(p.pid)
        return p, int(p.stdout.readline())

    def cleanup(self) -> None:
        for pgid in self.groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.started:
            if p.poll() is None:
                p.kill()
            p.wait()
        for pid in self.extra_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _q(path) -> str:
    import shlex

    return shlex.quote(str(path))


def alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def terminate(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; reaped either way (test servers: sshd, dockerd)."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.02)


def write_gpu_table(path: Path, gpus: list[dict]) -> Path:
    """The NVML stand-in the host agent reads (gpu_source = table:PATH): real pids, memory per process."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    tmp.rename(path)
    return path


class Freezer:
    """A cgroup-v1 freezer group: a frozen process sits in D state and survives SIGKILL until thawed,
    like a worker hung in nvidia_uvm."""

    BASE = Path("/sys/fs/cgroup/freezer")

    def __init__(self, name: str) -> None:
        assert self.BASE.is_dir(), "cgroup v1 freezer not mounted at /sys/fs/cgroup/freezer"
        self.path = self.BASE / name
        self.path.mkdir(exist_ok=True)

    def freeze(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))
        (self.path / "freezer.state").write_text("FROZEN")
        wait_for(lambda: (self.path / "freezer.state").read_text().strip() == "FROZEN")

    def thaw_and_remove(self) -> None:
        (self.path / "freezer.state").write_text("THAWED")
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for(lambda: not (self.path / "cgroup.procs").read_text().strip())
        self.path.rmdir()
