"""GPU facts, holder discovery and classification.

Owns turning the host agent's probe reply into typed facts (GPUs, compute processes, device-file
holders), classifying every holder as protected / server / orphan, and the clean check (per GPU: no
compute process and used memory under the threshold). Pure: the probe itself runs in ops/host/agent.py,
the killing in ops.clean.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ops.agent import call, probe_request
from ops.connection import Runner
from ops.errors import EXIT_NOT_CLEAN, OpsError
from ops.hosts import HostConfig

PROTECTED, SERVER, ORPHAN = "protected", "server", "orphan"


@dataclass(frozen=True)
class Proc:
    pid: int
    comm: str
    cmdline: str
    user: str
    state: str
    ppid: int
    pgid: int
    starttime: int
    container: str | None
    container_id: str | None
    devices: tuple[str, ...] = ()  # the device files (of the glob) it has open


@dataclass(frozen=True)
class Holder:
    """A process using a GPU (holds a device file and/or is an NVML compute process)."""

    proc: Proc
    klass: str  # protected | server | orphan
    reason: str
    gpus: tuple[int, ...]  # NVML GPU indices it runs on (empty: device file only)
    used_mib: int | None
    via: str  # fuser, nvml or fuser+nvml


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str
    memory_used_mib: int
    memory_total_mib: int
    memory_api: str
    memory_used_v1_mib: int
    util_gpu: int | None
    process_pids: tuple[int, ...]


@dataclass(frozen=True)
class ServerFacts:
    """What the probe found of the configured server."""

    kind: str
    container_ids: tuple[str, ...] = ()
    running_container_ids: tuple[str, ...] = ()
    pgid: int | None = None
    members: tuple[int, ...] = ()
    error: str | None = None
    # members that are ops' own processes (itself, a helper it started, the shell that runs it): the pid
    # file points at the operator, not at a server, and nothing of the group counts as the server's
    ours: tuple[int, ...] = ()

    @property
    def running(self) -> bool:
        return bool(self.running_container_ids or self.members) and not self.ours


@dataclass(frozen=True)
class GpuState:
    host: str
    hostname: str
    gpus: tuple[Gpu, ...]
    holders: tuple[Holder, ...]
    device_files: tuple[str, ...]
    gpu_error: str | None
    fuser_error: str | None
    server: ServerFacts
    ancestry: tuple[int, ...]
    parents: tuple[Proc, ...] = ()  # the holders' parent processes (to name a supervisor), never targets
    driver: str | None = None  # NVIDIA driver version as NVML reports it ("580.65.06")
    # the GPU fact source is not there at all (a `table:` file that does not exist, NVML that cannot load):
    # no retry can change that within a run, unlike a table read half-written
    gpu_error_lasting: bool = False

    def by_class(self, klass: str) -> list[Holder]:
        return [h for h in self.holders if h.klass == klass]


@dataclass(frozen=True)
class GpuCheck:
    index: int
    ok: bool
    reason: str


def _proc(d: dict) -> Proc:
    return Proc(
        pid=d["pid"],
        comm=d["comm"],
        cmdline=d["cmdline"],
        user=d["user"],
        state=d["state"],
        ppid=d["ppid"],
        pgid=d["pgid"],
        starttime=d["starttime"],
        container=d.get("container"),
        container_id=d.get("container_id"),
        devices=tuple(d.get("devices", ())),
    )


def classify(proc: Proc, host: HostConfig, server: ServerFacts, ancestry: set[int]) -> tuple[str, str]:
    argv0 = os.path.basename(proc.cmdline.split(" ", 1)[0]) if proc.cmdline else ""
    # /proc comm is cut to 15 characters ("nvidia-persistenced" reads "nvidia-persiste")
    hit = sorted(
        p
        for p in host.protected
        if p in (proc.comm, argv0) or (len(proc.comm) == 15 and p.startswith(proc.comm))
    )
    if hit:
        return PROTECTED, f"protected name {hit[0]}"
    if proc.pid in ancestry:
        return PROTECTED, "our own ancestry"
    if proc.container_id and proc.container_id in server.container_ids:
        return SERVER, f"in server container {proc.container or proc.container_id[:12]}"
    if server.ours:  # the pid file points at ops' own group: nothing of it is the server's
        return ORPHAN, "not protected, not the server"
    if server.pgid is not None and proc.pgid == server.pgid:
        return SERVER, f"in server process group {server.pgid}"
    if proc.pid in server.members:
        return SERVER, f"in server unit {host.server.target}"
    return ORPHAN, "not protected, not the server"


def parse_probe(reply: dict, host: HostConfig) -> GpuState:
    """Typed, classified facts from one probe reply."""
    s = reply["server"]
    running = tuple(
        cid
        for cid in s.get("container_ids", [])
        if reply["containers"].get(cid, {}).get("state") == "running"
    )
    server = ServerFacts(
        kind=s["kind"],
        container_ids=tuple(s.get("container_ids", [])),
        running_container_ids=running,
        pgid=s.get("pgid"),
        members=tuple(s.get("members", [])),
        error=s.get("error"),
        ours=tuple(s.get("ours", [])),
    )
    gpu = reply["gpu"]
    gpus = tuple(
        Gpu(
            index=g["index"],
            name=g["name"],
            uuid=g["uuid"],
            memory_used_mib=g["memory_used_mib"],
            memory_total_mib=g["memory_total_mib"],
            memory_api=g["memory_api"],
            memory_used_v1_mib=g.get("memory_used_v1_mib", g["memory_used_mib"]),
            util_gpu=g.get("util_gpu"),
            process_pids=tuple(p["pid"] for p in g["processes"]),
        )
        for g in gpu["gpus"]
    )
    used: dict[int, int] = {}
    on: dict[int, list[int]] = {}
    for g in gpu["gpus"]:
        for p in g["processes"]:
            on.setdefault(p["pid"], []).append(g["index"])
            if p.get("used_mib") is not None:
                used[p["pid"]] = used.get(p["pid"], 0) + p["used_mib"]
    fuser_pids = set(reply["fuser"]["pids"])
    ancestry = set(reply["ancestry"])
    holders = []
    for pid in sorted(fuser_pids | set(on)):
        d = reply["procs"].get(str(pid))
        if d is None:  # exited between fuser/NVML and the /proc read
            continue
        proc = _proc(d)
        klass, reason = classify(proc, host, server, ancestry)
        via = "+".join(x for x, hit in (("fuser", pid in fuser_pids), ("nvml", pid in on)) if hit)
        holders.append(Holder(proc, klass, reason, tuple(on.get(pid, ())), used.get(pid), via))
    return GpuState(
        host=host.name,
        hostname=reply["hostname"],
        gpus=gpus,
        holders=tuple(holders),
        device_files=tuple(reply["fuser"]["files"]),
        gpu_error=gpu.get("error"),
        fuser_error=reply["fuser"].get("error"),
        server=server,
        ancestry=tuple(reply["ancestry"]),
        parents=tuple(_proc(d) for _, d in sorted(reply.get("parents", {}).items())),
        driver=gpu.get("driver"),
        gpu_error_lasting=bool(gpu.get("error") and gpu.get("lasting")),
    )


def probe(runner: Runner, host: HostConfig) -> GpuState:
    return parse_probe(call(runner, host, probe_request(host)), host)


def probe_with_paths(runner: Runner, host: HostConfig, paths: dict) -> tuple[GpuState, dict]:
    """The GPU probe plus facts about host paths (see ops/host/agent.py paths), in one round trip."""
    reply = call(runner, host, {**probe_request(host), "paths": paths})
    return parse_probe(reply, host), reply["path_facts"]


def unreadable(state: GpuState, after: str = "") -> OpsError:
    """The one line for GPU facts that cannot be read, exit 6 (nothing can be proven clean); ``after``: what
    was or was not done."""
    return OpsError(
        f"cannot read the GPU facts of {state.host}: {state.gpu_error} (check the driver and `gpu_source` in "
        f"the hosts file){after}",
        exit_code=EXIT_NOT_CLEAN,
    )


def refuse_lasting(state: GpuState, after: str = "; nothing was stopped or signalled") -> None:
    """Refuse a GPU fact source that is not there at all, at the read that found it: waiting out a clean
    timeout cannot bring it (a missing `table:` file, NVML that cannot load), unlike busy GPUs."""
    if state.gpu_error_lasting:
        raise unreadable(state, after)


def check_clean(state: GpuState, threshold_mib: int) -> list[GpuCheck]:
    """Per GPU: clean iff no compute process and used memory (NVML v2, reserved excluded) < threshold.
    Without GPU facts nothing can be proven clean: one failing entry with the reason."""
    if state.gpu_error:
        return [GpuCheck(-1, False, f"cannot read GPUs: {state.gpu_error}")]
    out = []
    for g in state.gpus:
        if g.process_pids:
            out.append(GpuCheck(g.index, False, f"compute processes {', '.join(map(str, g.process_pids))}"))
        elif g.memory_used_mib >= threshold_mib:
            out.append(
                GpuCheck(g.index, False, f"{g.memory_used_mib} MiB used >= threshold {threshold_mib} MiB")
            )
        else:
            out.append(GpuCheck(g.index, True, f"no compute process, {g.memory_used_mib} MiB used"))
    return out
