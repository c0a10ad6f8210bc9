"""Property: over any generated process table, gpu-clean never plans to signal a protected process or
our own ancestry, and plans to signal every other GPU holder."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ops.clean import plan_clean
from ops.gpus import PROTECTED, parse_probe
from ops.hosts import DEFAULT_PROTECTED, HostConfig, parse_strategy

NAMES = [
    *DEFAULT_PROTECTED,
    "python3",
    "VLLM::EngineCor",
    "bash",
    "sshd",
    "nvidia-persiste",
    "torchrun",
    "Xorg2",
]


@st.composite
def process_tables(draw):
    pids = draw(st.lists(st.integers(2, 5000), min_size=1, max_size=25, unique=True))
    procs, fuser, nvml = {}, [], []
    server_pgid = draw(st.sampled_from([None, *pids]))
    for pid in pids:
        comm = draw(st.sampled_from(NAMES))
        use_full_name = draw(st.booleans())
        cmd = f"/usr/bin/{comm if not use_full_name or len(comm) < 15 else comm} --flag"
        procs[str(pid)] = {
            "pid": pid,
            "comm": comm[:15],
            "cmdline": cmd,
            "user": "root",
            "state": "S",
            "ppid": 1,
            "pgid": draw(st.sampled_from([pid, server_pgid or pid])),
            "starttime": pid * 7,
            "container": None,
            "container_id": None,
        }
        where = draw(st.sampled_from(["fuser", "nvml", "both"]))
        if where in ("fuser", "both"):
            fuser.append(pid)
        if where in ("nvml", "both"):
            nvml.append(pid)
    ancestry = draw(st.lists(st.sampled_from(pids), max_size=4, unique=True))
    reply = {
        "hostname": "gen",
        "ancestry": ancestry,
        "procs": procs,
        "containers": {},
        "server": {"kind": "pidfile", "container_ids": [], "pgid": server_pgid, "members": []},
        "fuser": {"pids": fuser, "files": ["/dev/nvidia0"]},
        "gpu": {
            "gpus": [
                {
                    "index": 0,
                    "name": "H200",
                    "uuid": "GPU-0",
                    "memory_used_mib": 100,
                    "memory_total_mib": 143771,
                    "memory_api": "v2",
                    "processes": [{"pid": p, "used_mib": 10} for p in nvml],
                }
            ]
        },
    }
    return reply


@settings(max_examples=300, deadline=None)
@given(reply=process_tables())
def test_gpu_clean_never_targets_protected_or_ancestry(reply):
    """Killed = holders minus protected names minus our ancestry; nothing else, nothing less."""
    host = HostConfig(name="gen", host="local", server=parse_strategy("pidfile:/run/server.pid"))
    state = parse_probe(reply, host)
    plan = plan_clean(state, host)
    killed = {h.proc.pid for h in plan.kill}
    ancestry = set(reply["ancestry"])
    protected_names = set(DEFAULT_PROTECTED)
    for pid_s, p in reply["procs"].items():
        pid = int(pid_s)
        argv0 = p["cmdline"].split(" ", 1)[0].rsplit("/", 1)[-1]
        is_protected = (
            pid in ancestry
            or p["comm"] in protected_names
            or argv0 in protected_names
            or any(n.startswith(p["comm"]) and len(p["comm"]) == 15 for n in protected_names)
        )
        holder = pid in reply["fuser"]["pids"] or any(
            pid == q["pid"] for q in reply["gpu"]["gpus"][0]["processes"]
        )
        if is_protected:
            assert pid not in killed, (pid, p)
        elif holder:
            assert pid in killed, (pid, p)
        else:
            assert pid not in killed
    assert all(h.klass == PROTECTED for h in plan.spare)
    assert killed.isdisjoint(h.proc.pid for h in plan.spare)
