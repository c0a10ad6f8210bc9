"""Calling the host agent (ops/host/agent.py) over a Runner.

Owns the bootstrap: one command, `python3 -c BOOTSTRAP`, whose stdin carries the agent's source, the
compressed nvidia-ml-py binding when NVML is needed, and the request. Requests travel on stdin, never in
argv (so later secrets never show in `ps`). Nothing is installed or written on the host.
Also owns building the requests (pure) so that tests and --dry-run can show them exactly.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import os
import shlex
import zlib
from pathlib import Path

from ops.connection import Runner
from ops.errors import OpsError, RemoteCommandError
from ops.hosts import HostConfig

BOOTSTRAP = (
    "import base64,json,sys,types,zlib\n"
    "b=json.load(sys.stdin)\n"
    "if b.get('pynvml'):\n"
    " m=types.ModuleType('pynvml');m.__file__='pynvml.py';sys.modules['pynvml']=m\n"
    " exec(compile(zlib.decompress(base64.b64decode(b['pynvml'])),'pynvml.py','exec'),m.__dict__)\n"
    "g={'__name__':'eagle_ops_hostagent'}\n"
    "exec(compile(b['agent'],'hostagent.py','exec'),g)\n"
    "sys.exit(g['main'](b['request']))\n"
)


@functools.cache
def _agent_source() -> str:
    return (Path(__file__).parent / "host" / "agent.py").read_text()


@functools.cache
def _pynvml_blob() -> str:
    """The pure-Python NVML binding (nvidia-ml-py) of this environment, compressed for the trip."""
    spec = importlib.util.find_spec("pynvml")
    if spec is None or spec.origin is None:
        raise OpsError(
            "nvidia-ml-py is not installed here; `pip install nvidia-ml-py` (ops sends it to the host)"
        )
    return base64.b64encode(zlib.compress(Path(spec.origin).read_bytes(), 9)).decode()


def command(host: HostConfig) -> str:
    """The one remote command line every agent call uses."""
    return shlex.join([host.python, "-c", BOOTSTRAP])


def probe_request(host: HostConfig) -> dict:
    return {
        "op": "probe",
        "device_glob": host.device_glob,
        "gpu_source": host.gpu_source,
        "server": {"kind": host.server.kind, "target": host.server.target},
        # who is ops here, so that a pid file pointing at it is told as such (the same set terminate spares)
        "client": client_identity(),
        "spare_ssh_session": not host.is_local,
    }


def terminate_request(
    targets: list[tuple[int, int]], groups: list[int], grace: float, kill_wait: float
) -> dict:
    return {
        "op": "terminate",
        "targets": [{"pid": p, "starttime": s} for p, s in targets],
        "groups": list(groups),
        "grace": grace,
        "kill_wait": kill_wait,
        "client": client_identity(),
    }


def client_identity() -> dict:
    """This ops process as the host agent can recognise it when both run on one machine (host `local`, or
    an SSH host that is this machine): its pid and start time, the boot and the pid namespace they count
    in. The agent never signals this process or any process under it (ops' own helpers: the lock keeper,
    a log follower, the agent itself), whatever a pid file or a process group names."""

    def first(path: str, read) -> str | None:
        try:
            return read(path)
        except OSError:
            return None  # not Linux: no machine for the agent to share

    stat = first("/proc/self/stat", lambda p: Path(p).read_text())
    return {
        "pid": os.getpid(),
        "starttime": int(stat[stat.rindex(")") + 2 :].split()[19]) if stat else None,
        "boot_id": first("/proc/sys/kernel/random/boot_id", lambda p: Path(p).read_text().strip()),
        "pid_ns": first("/proc/self/ns/pid", os.readlink),
    }


def call(runner: Runner, host: HostConfig, request: dict, *, timeout: float | None = None) -> dict:
    """Run one agent request on the host and return its JSON reply."""
    needs_nvml = request.get("op") == "probe" and host.gpu_source == "nvml"
    payload = {"agent": _agent_source(), "request": request, "pynvml": _pynvml_blob() if needs_nvml else None}
    res = runner.run(command(host), stdin=json.dumps(payload), timeout=timeout or host.timeouts.command)
    if res.exit_code == 127 or "not found" in res.stderr and not res.stdout:
        raise OpsError(f"{host.python} not found on {host.name}; set `python` in the hosts file")
    if not res.ok:
        raise RemoteCommandError(
            f"host agent ({request.get('op')})",
            f"{host.python} -c BOOTSTRAP",
            res.exit_code,
            res.stdout,
            res.stderr,
        )
    try:
        return json.loads(res.stdout)
    except ValueError:
        raise RemoteCommandError(
            f"host agent ({request.get('op')}) reply",
            f"{host.python} -c BOOTSTRAP",
            res.exit_code,
            res.stdout[-500:],
            res.stderr,
        ) from None
