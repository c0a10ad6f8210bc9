"""The host-side probe and terminator, run by the GPU host's own python3 (standard library only).

ops sends this file's source (and, for NVML, the pure-Python nvidia-ml-py binding) over the connection on
stdin and runs it with `python3 -c BOOTSTRAP`: nothing is installed or written on the host. It owns the
facts only the host can read: device-file holders (real `fuser`), /proc facts of each process (name,
user, state, parent, process group, start time, cgroup, container), NVML's GPUs and compute processes,
the server's identity (container ids, process group, unit) and our own ancestry; and it owns signalling
processes by identity (pid + start time, so a reused pid is never hit), never our ancestry.
It does not classify or decide who to kill: ops.gpus and ops.clean do that on the operator's side.
This module must not import anything from ops (it runs alone on the host).
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

CONTAINER_ID = re.compile(r"(?:docker[-/]|containerd[-/]|/)([0-9a-f]{64})(?:\.scope)?\b")
MIB = 1024 * 1024


def read(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return None


def stat_fields(pid: int) -> dict | None:
    """state, ppid, pgid, sid and start time (clock ticks since boot) from /proc/PID/stat."""
    text = read(f"/proc/{pid}/stat")
    if text is None:
        return None
    rest = text[text.rindex(")") + 2 :].split()
    return {
        "state": rest[0],
        "ppid": int(rest[1]),
        "pgid": int(rest[2]),
        "sid": int(rest[3]),
        "starttime": int(rest[19]),
    }


def proc_facts(pid: int, containers: dict) -> dict | None:
    st = stat_fields(pid)
    if st is None:
        return None
    comm = (read(f"/proc/{pid}/comm") or "").strip()
    cmdline = (read(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        user = pwd.getpwuid(uid).pw_name
    except (OSError, KeyError):
        user = "?"
    cgroup = read(f"/proc/{pid}/cgroup") or ""
    m = CONTAINER_ID.search(cgroup)
    cid = m.group(1) if m else None
    return dict(
        st,
        pid=pid,
        comm=comm,
        cmdline=cmdline[:300],
        user=user,
        cgroup=cgroup.strip()[:2000],
        container_id=cid,
        container=containers.get(cid, {}).get("name") if cid else None,
    )


def alive(pid: int, starttime: int | None = None) -> bool:
    """Running and not a zombie (a zombie holds no files and no GPU memory); same process if starttime."""
    st = stat_fields(pid)
    if st is None or st["state"] in ("Z", "X"):
        return False
    return starttime is None or st["starttime"] == starttime


def ancestry() -> list[int]:
    """This process and every parent up to PID 1: never signalled."""
    chain, pid = [], os.getpid()
    while pid > 0 and pid not in chain:
        chain.append(pid)
        st = stat_fields(pid)
        if st is None:
            break
        pid = st["ppid"]
    return chain


def docker_containers() -> tuple[dict, str | None]:
    """Every container's id -> name and compose labels (empty when docker is absent)."""
    if not shutil.which("docker"):
        return {}, "docker not found"
    fmt = "\t".join(
        (
            "{{.ID}}",
            "{{.Names}}",
            '{{.Label "com.docker.compose.project"}}',
            '{{.Label "com.docker.compose.service"}}',
            "{{.State}}",
        )
    )
    try:
        res = subprocess.run(
            ["docker", "ps", "-a", "--no-trunc", "--format", fmt], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {}, str(exc)
    if res.returncode != 0:
        return {}, res.stderr.strip()
    out = {}
    for line in res.stdout.splitlines():
        parts = line.split("\t")
        if len(parts) == 5:
            out[parts[0]] = {"name": parts[1], "project": parts[2], "service": parts[3], "state": parts[4]}
    return out, None


def fuser_pids(device_glob: str) -> dict:
    files = sorted(glob.glob(device_glob))
    if not files:
        return {"files": [], "pids": [], "error": None}
    if not shutil.which("fuser"):
        return {"files": files, "pids": [], "error": "fuser not found (install psmisc)"}
    # pids on stdout; file names, access letters and unreadable-/proc notes on stderr
    res = subprocess.run(["fuser", *files], capture_output=True, text=True)
    pids = sorted({int(tok) for tok in re.findall(r"\d+", res.stdout)})
    return {"files": files, "pids": pids, "error": None}


def open_files(pid: int, files: list[str]) -> list[str]:
    """Which of the device files the process has open (its /proc/PID/fd links; empty if unreadable)."""
    wanted, out = set(files), set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target in wanted:
            out.add(target)
    return sorted(out)


def nvml_facts() -> dict:
    try:
        import pynvml as N
    except ImportError as exc:
        return {"ok": False, "error": f"nvidia-ml-py not available: {exc}", "gpus": [], "lasting": True}
    try:
        N.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no retry will load it
        return {"ok": False, "error": f"NVML init failed: {exc}", "gpus": [], "lasting": True}
    try:
        driver = N.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(N.nvmlDeviceGetCount()):
            h = N.nvmlDeviceGetHandleByIndex(i)
            try:
                mem, api = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2), "v2"
            except Exception:
                mem, api = N.nvmlDeviceGetMemoryInfo(h), "v1"
            mem_v1 = N.nvmlDeviceGetMemoryInfo(h)
            try:
                util = N.nvmlDeviceGetUtilizationRates(h).gpu
            except Exception:
                util = None
            procs = [
                {"pid": p.pid, "used_mib": (p.usedGpuMemory // MIB) if p.usedGpuMemory else None}
                for p in N.nvmlDeviceGetComputeRunningProcesses(h)
            ]
            gpus.append(
                {
                    "index": i,
                    "name": _s(N.nvmlDeviceGetName(h)),
                    "uuid": _s(N.nvmlDeviceGetUUID(h)),
                    "memory_total_mib": mem.total // MIB,
                    "memory_used_mib": mem.used // MIB,
                    "memory_api": api,
                    "memory_used_v1_mib": mem_v1.used // MIB,
                    "util_gpu": util,
                    "processes": procs,
                }
            )
        return {"ok": True, "error": None, "driver": _s(driver), "gpus": gpus}
    finally:
        N.nvmlShutdown()


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def table_facts(path: str) -> dict:
    """An NVML stand-in for hosts without GPUs: a JSON table of GPUs and their compute processes (real
    pids). Like NVML, a process that has exited is not listed and its memory is no longer used."""
    try:
        fh = open(path)
    except OSError as exc:  # missing or unreadable: a source that is not there, not GPUs that are busy
        return {"ok": False, "error": f"GPU table {path}: {exc}", "gpus": [], "lasting": True}
    try:
        with fh:
            table = json.load(fh)
    except (OSError, ValueError) as exc:  # a table being rewritten may read whole at the next probe
        return {"ok": False, "error": f"GPU table {path}: {exc}", "gpus": []}
    gpus = []
    for i, gpu in enumerate(table.get("gpus", [])):
        procs = [p for p in gpu.get("processes", []) if alive(int(p["pid"]))]
        used = int(gpu.get("base_used_mib", 0)) + sum(int(p.get("used_mib", 0)) for p in procs)
        gpus.append(
            {
                "index": i,
                "name": gpu.get("name", "table GPU"),
                "uuid": gpu.get("uuid", f"GPU-table-{i}"),
                "memory_total_mib": int(gpu.get("memory_total_mib", 81920)),
                "memory_used_mib": used,
                "memory_api": "table",
                "memory_used_v1_mib": used,
                "util_gpu": gpu.get("util_gpu", 0),
                "processes": [{"pid": int(p["pid"]), "used_mib": p.get("used_mib")} for p in procs],
            }
        )
    return {"ok": True, "error": None, "driver": str(table.get("driver", "table")), "gpus": gpus}


def pidfile_group(path: str) -> dict:
    """The server's process group from its pid file: the group of the pid if it runs, else the pid itself
    (a server started as group leader keeps pgid == its pid even after the leader died)."""
    text = read(path)
    if text is None:
        return {"pidfile": path, "error": "pid file not found", "pid": None, "pgid": None, "members": []}
    try:
        pid = int(text.strip().split()[0])
    except (ValueError, IndexError):
        return {
            "pidfile": path,
            "error": f"pid file holds {text.strip()[:40]!r}",
            "pid": None,
            "pgid": None,
            "members": [],
        }
    st = stat_fields(pid)
    if st is not None and st["state"] != "Z" and started_at(st) > os.stat(path).st_mtime + 2:
        # the process with this pid started after the pid file was written: the pid was reused by
        # someone else, whose group must not be taken for the server's
        return {
            "pidfile": path,
            "error": f"pid {pid} was reused (started after the pid file was written)",
            "pid": pid,
            "pgid": None,
            "members": [],
        }
    pgid = st["pgid"] if st is not None and st["state"] != "Z" else pid
    return {
        "pidfile": path,
        "error": None,
        "pid": pid,
        "pid_alive": alive(pid),
        "pgid": pgid,
        "members": group_members(pgid),
    }


def started_at(st: dict) -> float:
    """Wall-clock start of a process from its start time in clock ticks since boot."""
    btime = next(
        int(line.split()[1])
        for line in (read("/proc/stat") or "btime 0").splitlines()
        if line.startswith("btime")
    )
    return btime + st["starttime"] / os.sysconf("SC_CLK_TCK")


def group_members(pgid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = stat_fields(int(name))
            if st is not None and st["pgid"] == pgid and st["state"] not in ("Z", "X"):
                out.append(int(name))
    return sorted(out)


def same_connection() -> set[int]:
    """Every process started over this agent's own SSH connection (the lock keeper, the log follower, their
    shells): those whose environment carries our SSH_CONNECTION (client address and port: one per
    connection). Empty when the agent does not run over SSH."""
    ours = os.environ.get("SSH_CONNECTION")
    if not ours:
        return set()
    needle = ("SSH_CONNECTION=" + ours).encode()
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as fh:
                    if needle in fh.read().split(b"\0"):
                        out.add(int(name))
            except OSError:
                pass
    return out


def client_tree(client: dict | None) -> set[int]:
    """The ops process that sent the request and every process under it, when it runs on this machine
    (same boot, same pid namespace, its pid's start time unchanged); empty when it runs elsewhere."""
    if not client or client.get("boot_id") is None or client.get("pid_ns") is None:
        return set()
    try:
        here = (read("/proc/sys/kernel/random/boot_id") or "").strip(), os.readlink("/proc/self/ns/pid")
    except OSError:
        return set()
    root = int(client["pid"])
    st = stat_fields(root)
    if here != (client["boot_id"], client["pid_ns"]) or st is None or st["starttime"] != client["starttime"]:
        return set()
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := stat_fields(int(name))) is not None:
            children.setdefault(fields["ppid"], []).append(int(name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree


def unit_members(unit: str) -> list[int]:
    out = []
    needle = "/" + unit
    for name in os.listdir("/proc"):
        if name.isdigit():
            cg = read(f"/proc/{name}/cgroup") or ""
            if any(line.endswith(needle) or (needle + "/") in line for line in cg.splitlines()):
                if alive(int(name)):
                    out.append(int(name))
    return sorted(out)


def unit_state(unit: str) -> dict:
    """systemd's LoadState of the unit; an error when the unit does not exist or systemd cannot be asked."""
    if not shutil.which("systemctl"):
        return {"error": "systemctl not found (no systemd on this host)"}
    try:
        res = subprocess.run(
            ["systemctl", "show", "--property=LoadState", "--value", unit],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"systemctl: {exc}"}
    lines = (res.stderr.strip() or res.stdout.strip()).splitlines()
    if res.returncode != 0:
        return {"error": f"systemctl: {lines[-1] if lines else f'exit {res.returncode}'}"}
    state = res.stdout.strip()
    return {
        "load_state": state,
        "error": f"unit {unit} is {state}" if state in ("not-found", "bad-setting") else None,
    }


def probe(req: dict) -> dict:
    containers, docker_error = docker_containers()
    fuser = fuser_pids(req.get("device_glob", "/dev/nvidia*"))
    source = req.get("gpu_source", "nvml")
    gpu = nvml_facts() if source == "nvml" else table_facts(source.split(":", 1)[1])
    server = {"kind": req.get("server", {}).get("kind", "none")}
    target = req.get("server", {}).get("target", "")
    pids = set(fuser["pids"]) | {p["pid"] for g in gpu["gpus"] for p in g["processes"]}
    if server["kind"] in ("container", "compose") and docker_error:
        server["error"] = f"docker: {docker_error}"
    if server["kind"] == "container":
        server["container_ids"] = [cid for cid, c in containers.items() if c["name"] == target]
    elif server["kind"] == "compose":
        project, service = target.split("/", 1)
        server["container_ids"] = [
            cid for cid, c in containers.items() if c["project"] == project and c["service"] == service
        ]
    elif server["kind"] == "pidfile":
        server.update(pidfile_group(target))
        # a pid file that points at ops itself, a helper it started or the operator's shell: named as such,
        # never as the server's
        server["ours"] = sorted(set(server["members"]) & own_processes(req)) if server["members"] else []
        pids |= set(server["members"])
    elif server["kind"] == "systemd":
        server["unit"] = target
        server["members"] = unit_members(target)
        server.update(unit_state(target))
    procs = {}
    for pid in sorted(pids):
        facts = proc_facts(pid, containers)
        if facts is not None:
            facts["devices"] = open_files(pid, fuser["files"])
            procs[str(pid)] = facts
    # the holders' parents too (named when a supervisor respawns what gpu-clean killed); never signalled
    parents = {}
    for facts in list(procs.values()):
        ppid = facts["ppid"]
        if ppid > 0 and str(ppid) not in procs and str(ppid) not in parents:
            parent = proc_facts(ppid, containers)
            if parent is not None:
                parents[str(ppid)] = parent
    out = {
        "hostname": socket.gethostname(),
        "agent_pid": os.getpid(),
        "ancestry": ancestry(),
        "fuser": fuser,
        "gpu": gpu,
        "procs": procs,
        "parents": parents,
        "server": server,
        "containers": containers,
        "docker_error": docker_error,
    }
    if req.get("paths"):  # remote-run's path facts, in the same round trip
        out["path_facts"] = paths(req["paths"])
    return out


def own_processes(req: dict) -> set[int]:
    """ops' own processes as this machine shows them, never signalled nor taken for a server's: the agent's
    ancestry, the ops process that sent the request and every process under it (when it runs here), and,
    when the request asks, every process started over this agent's SSH connection."""
    ours = set(ancestry()) | client_tree(req.get("client"))
    return ours | (same_connection() if req.get("spare_ssh_session") else set())


def terminate(req: dict) -> dict:
    """SIGTERM the targets, wait up to `grace`, SIGKILL the rest, wait up to `kill_wait`, report.

    Targets are {pid, starttime} (a pid whose start time changed is another process: skipped) and whole
    process groups {pgid} (members re-read before each signal, so re-parented children are caught).
    A process we may not signal (EPERM: another user's, and we are not root) is reported as denied at
    once and dropped from the targets: waiting for it or sending it SIGKILL cannot change anything."""
    started = time.monotonic()
    ours = own_processes(req)
    grace, kill_wait = float(req.get("grace", 10)), float(req.get("kill_wait", 5))
    fixed = {int(t["pid"]): int(t["starttime"]) for t in req.get("targets", [])}
    groups = [int(g) for g in req.get("groups", [])]
    skipped, record, denied = [], {}, {}

    def current() -> dict[int, int | None]:
        cur = {pid: st for pid, st in fixed.items() if alive(pid, st)}
        for pgid in groups:
            for pid in group_members(pgid):
                cur.setdefault(pid, None)
        for pid in list(cur):
            if pid in denied:
                cur.pop(pid)
            elif pid in ours:
                cur.pop(pid)
                if pid not in {s["pid"] for s in skipped}:
                    reason = "our own ancestry, ops' own processes or SSH connection"
                    skipped.append({"pid": pid, "reason": reason})
        return cur

    def send(sig: int, name: str) -> None:
        for pid in current():
            try:
                os.kill(pid, sig)
                record.setdefault(
                    pid, {"pid": pid, "comm": (read(f"/proc/{pid}/comm") or "").strip(), "signals": []}
                )["signals"].append(name)
            except ProcessLookupError:
                pass
            except PermissionError as exc:
                facts = proc_facts(pid, {}) or {}
                denied[pid] = {
                    "pid": pid,
                    "comm": facts.get("comm", ""),
                    "user": facts.get("user", "?"),
                    "signal": name,
                    "error": exc.strerror,
                    "as_uid": os.geteuid(),
                }

    def wait(seconds: float) -> dict:
        deadline = time.monotonic() + seconds
        while True:
            cur = current()
            if not cur or time.monotonic() >= deadline:
                return cur
            time.sleep(0.05)

    for pid, st in fixed.items():
        if not alive(pid, st):
            skipped.append({"pid": pid, "reason": "already gone or pid reused"})
    if current():
        send(signal.SIGTERM, "TERM")
        if wait(grace):
            send(signal.SIGKILL, "KILL")
            wait(kill_wait)
    survivors = []
    for pid in current():
        st = stat_fields(pid) or {}
        survivors.append(
            {
                "pid": pid,
                "comm": (read(f"/proc/{pid}/comm") or "").strip(),
                "state": st.get("state"),
                "wchan": (read(f"/proc/{pid}/wchan") or "").strip(),
            }
        )
    return {
        "signalled": sorted(record.values(), key=lambda r: r["pid"]),
        "survivors": survivors,
        "skipped": skipped,
        "denied": sorted(denied.values(), key=lambda r: r["pid"]),
        "elapsed_s": round(time.monotonic() - started, 3),
    }


def paths(req: dict) -> dict:
    """Facts about host paths given as data (never through a shell): existence, kind, entry count,
    free bytes of the file system that holds them, small JSON files' contents."""
    facts = {}
    for path in req.get("paths", []):
        try:
            st = os.stat(path)
        except OSError:
            facts[path] = {"exists": False}
            continue
        is_dir = os.path.isdir(path)
        facts[path] = {
            "exists": True,
            "is_dir": is_dir,
            "entries": len(os.listdir(path)) if is_dir else None,
            "uid": st.st_uid,
            "gid": st.st_gid,
            "mode": st.st_mode & 0o7777,
        }
    free = {}
    for path in req.get("free", []):
        probe_at = path
        while probe_at and not os.path.exists(probe_at):
            probe_at = os.path.dirname(probe_at)
        vfs = os.statvfs(probe_at or "/")
        free[path] = vfs.f_bavail * vfs.f_frsize
    docs = {}
    for path in req.get("json", []):
        try:
            if os.path.getsize(path) < (1 << 20):
                with open(path) as fh:
                    docs[path] = json.load(fh)
        except (OSError, ValueError):
            docs[path] = None
    weights = {}
    for path in req.get("weights", []):  # a checkpoint folder's weight bytes (contract.backends.weight_file)
        try:
            weights[path] = sum(
                e.stat().st_size
                for e in os.scandir(path)
                if e.is_file()
                and e.name.endswith((".safetensors", ".bin", ".pt"))
                and not e.name.startswith(".")
            )
        except OSError:
            weights[path] = None
    return {"paths": facts, "free": free, "json": docs, "weights": weights}


OPS = {"probe": probe, "terminate": terminate, "paths": paths}


def main(req: dict) -> int:
    op = OPS.get(req.get("op", ""))
    if op is None:
        json.dump({"error": f"unknown op {req.get('op')!r}"}, sys.stdout)
        return 2
    json.dump(op(req), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.load(sys.stdin)))
