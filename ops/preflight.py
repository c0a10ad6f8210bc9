"""Host preflight for a stage run: everything that can be checked in seconds before anything is stopped.

Owns the checks (docker, image and its digest, GPU count, input folders, model, free disk against the
expected output size, output folder empty unless --resume, no other stage container running; for a stage
that asks the running server instead of the GPUs, that the server runs). Each
returns a CheckResult; nothing here stops, starts or writes anything, and only the CLI exits.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from contract import sizes
from contract.experts import dequantized_extra_bytes, experts_met
from contract.stages import STAGES
from ops.connection import Runner
from ops.gpus import GpuState
from ops.hosts import HostConfig
from ops.inventory import stage_containers
from ops.stage import StagePlan, host_path
from ops.trainsplit import check_gpu_count

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str
    detail: str


@dataclass(frozen=True)
class ImageFacts:
    digest: str | None = None  # repo digests, else the image id; None: no such image on the host
    min_driver: str | None = None  # the image's eagle-ops.min-driver label (NVIDIA driver major); None: none


MIN_DRIVER_LABEL = "eagle-ops.min-driver"  # set by the Dockerfile (ARG MIN_DRIVER)


def docker_checks(runner: Runner, host: HostConfig, run_id: str) -> tuple[list[CheckResult], ImageFacts]:
    """docker present and answering, image present (its id, digest and driver requirement): one
    `docker image inspect`; no other stage running and the run id unused: one `docker ps`."""
    fmt = "{{.Id}} {{json .RepoDigests}} {{json .Config.Labels}}"
    res = runner.run(shlex.join(["docker", "image", "inspect", "--format", fmt, host.image]))
    if res.exit_code == 127 or "command not found" in res.stderr:
        return [CheckResult("docker", FAIL, f"docker is not installed on {host.name}")], ImageFacts()
    if not res.ok and "No such image" not in res.stderr:
        return [
            CheckResult("docker", FAIL, f"docker daemon not reachable: {_last(res.stderr)}")
        ], ImageFacts()
    out = [CheckResult("docker", OK, "answers")]
    image = ImageFacts()
    if res.ok:
        image_id, digests, labels = (res.stdout.strip().split(" ", 2) + ["", ""])[:3]
        digest = ",".join(json.loads(digests or "[]") or []) or image_id
        image = ImageFacts(digest, (json.loads(labels or "null") or {}).get(MIN_DRIVER_LABEL) or None)
        out.append(CheckResult("image", OK, f"{host.image} {digest}"))
    else:
        out.append(
            CheckResult(
                "image",
                FAIL,
                f"image {host.image} is not on {host.name}; build or ship it "
                f"(make ship-image HOST={host.name})",
            )
        )
    found = stage_containers(runner) or []
    busy = [c.name for c in found if c.running]
    used = [c.name for c in found if c.run_id == run_id]
    out.append(
        CheckResult(
            "busy",
            FAIL if busy else OK,
            f"stage container(s) running: {', '.join(busy)}; attach or wait" if busy else "no stage running",
        )
    )
    out.append(
        CheckResult(
            "run-id",
            FAIL if used else OK,
            f"container {used[0]} of run {run_id} exists; `attach {run_id}` or choose another --run-id"
            if used
            else f"{run_id} unused",
        )
    )
    return out, image


def _last(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no output"


def gpu_check(state: GpuState) -> CheckResult:
    if state.gpu_error:
        return CheckResult("gpus", FAIL, state.gpu_error)
    if not state.gpus:
        return CheckResult("gpus", FAIL, "no GPU found")
    return CheckResult("gpus", OK, f"{len(state.gpus)} x {state.gpus[0].name}")


def server_checks(
    host: HostConfig, plan: StagePlan, state: GpuState, min_driver: str | None
) -> list[CheckResult]:
    """The GPUs and the driver for a stage that stops the server. A server-up stage (regenerate) uses no GPU:
    the server must run (it is never started or stopped for it), and GPU facts are only shown (a failing one
    is a warning); a server-kept stage (prepare, weights) needs neither GPU nor server: GPU facts shown."""
    gpus = [gpu_check(state), driver_check(state, min_driver)]
    if plan.stops_server:
        return gpus
    not_needed = f" (not needed: {plan.stage} uses no GPU)"
    shown = [CheckResult(c.name, WARN, c.detail + not_needed) if c.status == FAIL else c for c in gpus]
    return [server_running_check(host, plan, state), *shown] if plan.server_up else shown


def server_running_check(host: HostConfig, plan: StagePlan, state: GpuState) -> CheckResult:
    """The configured server runs (by its strategy's facts); whether it answers for the model is the check in
    the image. Strategy none: nothing to look at here."""
    facts, asked = state.server, f"asked at {host.server_endpoint}"
    if host.server.kind == "none":
        return CheckResult("server", OK, f"strategy none; {asked} (the check in the image)")
    if facts.error:
        return CheckResult("server", FAIL, f"server {host.server}: {facts.error}")
    if not facts.running:
        return CheckResult(
            "server",
            FAIL,
            f"server {host.server} is not running on {host.name}: {plan.stage} asks it and never starts or "
            "stops it; start it (restore-server), then re-run",
        )
    return CheckResult("server", OK, f"{host.server} running, kept up; {asked}")


def split_check(plan: StagePlan, state: GpuState) -> CheckResult | None:
    """train with produced states: the hosts file's producer/trainer GPUs against the GPUs the probe found
    (None: no split to check, or no GPU facts: gpu_check reports those)."""
    ts = plan.train.states if plan.train is not None else None
    if ts is None or (ts.shared and not ts.data_parallel) or not state.gpus:
        return None
    why = check_gpu_count(plan.train.states, len(state.gpus))
    return CheckResult("gpu split", FAIL, why) if why else CheckResult("gpu split", OK, plan.train.why[1])


def driver_check(state: GpuState, min_driver: str | None) -> CheckResult:
    """The host's NVIDIA driver against the image's requirement: vLLM 0.32's and torch 2.13's CUDA 13.0
    builds do not start on an older driver (docs/image.md), and finding that out takes a model load."""
    if not min_driver:
        return CheckResult("driver", OK, f"{state.driver or 'unknown'}; the image states no requirement")
    have = state.driver or ""
    major = int(have.split(".")[0]) if have.split(".")[0].isdigit() else None
    if major is None:
        return CheckResult(
            "driver",
            WARN,
            f"driver version unknown ({have or 'not reported'}); the image needs >= {min_driver}",
        )
    if major < int(min_driver):
        return CheckResult(
            "driver",
            FAIL,
            f"NVIDIA driver {have} on {state.host} is older than the image needs "
            f"(>= {min_driver}: its vLLM and torch are CUDA 13.0 builds); upgrade "
            'the host\'s driver (docs/image.md, "Which vLLM wheel")',
        )
    return CheckResult("driver", OK, f"{have} >= {min_driver}")


def _meta_and_config(host: HostConfig) -> tuple[str, str]:
    return host_path(host, "prepared/metadata.json"), f"{host.model_dir.rstrip('/')}/config.json"


def paths_request(host: HostConfig, plan: StagePlan) -> dict:
    """What the host agent must report about the run's paths (sent along with the GPU probe)."""
    meta, config = _meta_and_config(host)
    return {
        "paths": [host.data_root, host.model_dir, host.cache_dir, *plan.host_inputs, plan.host_output],
        "free": [plan.host_output],
        # extract's disk check reads both; the layout's backend rule weighs the config's experts
        "json": [meta, config] if plan.stage == "extract" else [],
        # the layout's backend rule (contract/backends.py) weighs the checkpoint against one GPU
        "weights": [host.model_dir] if STAGES[plan.stage].layout else [],
    }


def model_experts(host: HostConfig, facts: dict) -> tuple[int, int]:
    """The target's (k, E) routed experts from the config.json the agent read (`paths_request` asks for it
    where the layout's backend rule weighs it); (0, 0) for a dense model or a config not read."""
    _, config = _meta_and_config(host)
    return experts_met((facts.get("json") or {}).get(config))


def model_dequantized_extra(host: HostConfig, facts: dict) -> int:
    """What a quantized target's experts gain on the GPU when hf dequantizes them (contract/experts.py), from
    the same config.json; 0 for an unquantized one or a config not read."""
    _, config = _meta_and_config(host)
    return dequantized_extra_bytes((facts.get("json") or {}).get(config))


def path_checks(host: HostConfig, plan: StagePlan, facts: dict) -> list[CheckResult]:
    """Inputs and model present, output empty unless --resume, free disk for extract; from the agent's
    path facts (`paths_request`)."""
    meta, config = _meta_and_config(host)
    paths = facts["paths"]
    out = []
    for p in (host.data_root, *plan.host_inputs):
        ok = paths[p].get("exists")
        out.append(CheckResult("input", OK if ok else FAIL, f"{p} {'present' if ok else 'missing'}"))
    if STAGES[plan.stage].uses_model:
        ok = paths[host.model_dir].get("is_dir")
        out.append(
            CheckResult("model", OK if ok else FAIL, f"{host.model_dir} {'present' if ok else 'missing'}")
        )
    o = paths[plan.host_output]
    if plan.stage != "verify":
        if o.get("exists") and o.get("entries") and not plan.resume:
            out.append(
                CheckResult(
                    "output",
                    FAIL,
                    f"{plan.host_output} has {o['entries']} entries; pass --resume "
                    "to continue it or move it away",
                )
            )
        else:
            out.append(
                CheckResult("output", OK, f"{plan.host_output} {'resumed' if o.get('entries') else 'empty'}")
            )
    if plan.stage == "extract":
        out.append(
            _disk_check(
                facts["json"].get(meta),
                facts["json"].get(config),
                facts["free"][plan.host_output],
                plan.dtype,
                plan.world_size,
            )
        )
    return out


def _disk_check(
    meta: dict | None, config: dict | None, free: int, dtype: str | None = None, world: int = 1
) -> CheckResult:
    if not meta or not config:
        return CheckResult("disk", WARN, f"{free / 2**30:.1f} GiB free; size unknown (no metadata or config)")
    hidden = config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size")
    tokens = meta.get("num_tokens")
    if not hidden or not tokens:
        return CheckResult(
            "disk", WARN, f"{free / 2**30:.1f} GiB free; size unknown (no hidden_size/num_tokens)"
        )
    # float32 only when asked for (auto is bf16 on a GPU); a host of --world-size N writes about 1/N
    need = sizes.hidden_states_bytes(
        int(tokens), int(meta.get("num_samples") or 0), int(hidden), dtype, world
    )
    ok = free >= need
    share = f" / {world} hosts" if world > 1 else ""
    return CheckResult(
        "disk",
        OK if ok else FAIL,
        f"need {need / 2**30:.3f} GiB ({tokens} tokens x {hidden} x 4 layers x {sizes.dtype_bytes(dtype)} B"
        f"{share}), {free / 2**30:.1f} GiB free",
    )


def _may(fact: dict, uid: int, gid: int, bit: int) -> bool:
    """Whether uid:gid has permission `bit` (4 read, 2 write) on a path, from its owner, group and mode."""
    mode = fact.get("mode", 0)
    if fact.get("uid") == uid:
        return bool(mode & (bit << 6))
    if fact.get("gid") == gid:
        return bool(mode & (bit << 3))
    return bool(mode & bit)


def user_check(host: HostConfig, plan: StagePlan, facts: dict) -> CheckResult:
    """The stage's user (non-root) can write the data root, cache and output and read the model: found out
    now, not after the server was stopped. Root in the container (no capability: no DAC override) is
    judged the same way."""
    user = plan.docker_run[plan.docker_run.index("--user") + 1]
    if ":" not in user:  # "auto" with no data root: the input check already failed
        return CheckResult("user", WARN, f"stage user {user} not resolved")
    uid, gid = (int(x) for x in user.split(":"))
    paths = facts["paths"]
    need = [(host.data_root, 2), (host.cache_dir, 2), (plan.host_output, 2)]
    if STAGES[plan.stage].uses_model:
        need.append((host.model_dir, 4))
    for path, bit in need:
        fact = paths.get(path, {})
        if fact.get("exists") and not _may(fact, uid, gid, bit):
            what = "write" if bit == 2 else "read"
            return CheckResult(
                "user",
                FAIL,
                f"the stage runs as {user} but cannot {what} {path} (owner "
                f"{fact['uid']}:{fact['gid']}, mode {fact['mode']:o}); chown it "
                "or set stage_user in the hosts file",
            )
    return CheckResult(
        "user",
        OK,
        f"stage runs as {user}" + (" (owner of the data root)" if host.stage_user == "auto" else ""),
    )


def secrets_check(host: HostConfig, plan: StagePlan) -> CheckResult:
    """Which configured secrets travel (names only); one configured but unset here is a warning (a public
    model needs no HF_TOKEN, a gated one fails at download)."""
    missing = [n for n in host.secrets if n not in plan.secret_names]
    passed = ", ".join(plan.secret_names) or "none"
    if missing:
        return CheckResult(
            "secrets", WARN, f"not set on this machine: {', '.join(missing)}; passed: {passed}"
        )
    return CheckResult(
        "secrets",
        OK,
        f"passed: {passed}" + (" (0600 env file, removed once started)" if plan.secret_names else ""),
    )


def failed(checks: list[CheckResult]) -> list[CheckResult]:
    return [c for c in checks if c.status == FAIL]
