"""Stage container plans: what runs in the image, with which mounts, under which name and labels.

Owns the per-stage defaults (container command, input and output folders under the data root), the run
id, the stage container's privileges, and the exact `docker run` / `docker logs` / `docker wait` argv. Pure: running them is
ops.remote_run's job. Host paths are passed to docker as data (--mount fields, CSV-quoted), never
interpolated into a shell string unquoted.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import secrets
import shlex
import time
from dataclasses import dataclass

from ops import secret_env
from ops.errors import ConfigError
from ops.hosts import HostConfig, check_label

LABEL_RUN, LABEL_STAGE, LABEL_OUT, LABEL_HOST = "eagle-ops.run-id", "eagle-ops.stage", "eagle-ops.output", "eagle-ops.host"
DATA, MODEL, CACHE = "/data", "/model", "/cache"
AUTO_USER = "auto"  # placeholder until preflight knows the data root's owner (resolve_user)


@dataclass(frozen=True)
class StageSpec:
    """A stage's defaults, paths relative to the data root."""

    inputs: tuple[str, ...]  # must exist on the host before the run
    output: str  # the folder the stage writes (and summary.json lands in)
    args: tuple[str, ...]  # `python -m pipeline STAGE ARGS` (container paths)
    verify_after: bool  # run `pipeline verify OUTPUT` after the stage (extract verifies itself)
    uses_model: bool = True


STAGES: dict[str, StageSpec] = {
    "prepare": StageSpec(("conversations.jsonl",), "prepared",
                         ("--data", f"{DATA}/conversations.jsonl", "--model", MODEL, "--out", f"{DATA}/prepared"), False),
    "extract": StageSpec(("prepared",), "hidden_states",
                         ("--prepared", f"{DATA}/prepared", "--model", MODEL, "--out", f"{DATA}/hidden_states",
                          "--no-progress"), False),
    "weights": StageSpec((), "verifier", ("--model", MODEL, "--out", f"{DATA}/verifier"), True),
    "train": StageSpec(("hidden_states", "verifier", "prepared"), "train",
                       ("--data", f"{DATA}/hidden_states", "--verifier", f"{DATA}/verifier", "--prepared",
                        f"{DATA}/prepared", "--model", MODEL, "--out", f"{DATA}/train"), True),
    "verify": StageSpec(("hidden_states",), "hidden_states", (f"{DATA}/hidden_states",), False, uses_model=False),
}


def new_run_id(stage: str) -> str:
    return f"{stage}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


def check_run_id(run_id: str) -> str:
    return check_label(run_id, "run id")


@dataclass(frozen=True)
class StagePlan:
    run_id: str
    stage: str
    container: str
    image: str
    host_inputs: tuple[str, ...]
    host_output: str
    stage_argv: tuple[str, ...]
    verify_argv: tuple[str, ...] | None
    docker_run: tuple[str, ...]
    resume: bool
    secret_names: tuple[str, ...] = ()  # variables passed through the env file (names only; never values)
    env_dir: str | None = None  # host directory of the env file while `docker run` reads it


def host_path(host: HostConfig, rel: str) -> str:
    return f"{host.data_root.rstrip('/')}/{rel}"


def _mount(src: str, dst: str, readonly: bool = False) -> str:
    """One --mount value; fields are CSV, so a path with commas or quotes is quoted, not split."""
    buf = io.StringIO()
    fields = ["type=bind", f"source={src}", f"target={dst}"] + (["readonly"] if readonly else [])
    csv.writer(buf, lineterminator="").writerow(fields)
    return buf.getvalue()


def privilege_args(host: HostConfig) -> list[str]:
    """Least privilege the GPU stack allows (docs/ops.md, "Stage container privileges"): no capability,
    no privilege gain through setuid files, a process/thread cap, read-only root file system with a
    private /tmp, a non-root user when the data root's owner is one, a private IPC namespace with a
    sized /dev/shm (NCCL and vLLM's message queues need shared memory, not the host's IPC namespace).
    GPUs come only through --gpus (device requests); never --privileged."""
    user = {"auto": AUTO_USER, "root": "0:0"}.get(host.stage_user, host.stage_user)
    argv = ["--user", user, "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    if host.stage_pids_limit:
        argv += ["--pids-limit", str(host.stage_pids_limit)]
    if host.stage_read_only:
        argv += ["--read-only", "--tmpfs", "/tmp:rw,exec,nosuid,nodev,mode=1777"]
    argv += ["--ipc", "host"] if host.stage_ipc == "host" else ["--ipc", "private", "--shm-size", host.stage_shm_size]
    return argv


def plan_stage(host: HostConfig, stage: str, *, run_id: str, extra_args: tuple[str, ...] = (),
               resume: bool = False, secret_names: tuple[str, ...] = (), env_token: str | None = None) -> StagePlan:
    """`secret_names`: variables (set on the operator's machine) that reach the container through the env
    file; `env_token` names its directory (random by default)."""
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")
    spec = STAGES[stage]
    check_run_id(run_id)
    stage_argv = ("python", "-m", "pipeline", stage, *spec.args, *(("--resume",) if resume and stage in (
        "extract", "train") else ()), *extra_args)
    verify_argv = ("python", "-m", "pipeline", "verify", f"{DATA}/{spec.output}") if spec.verify_after else None
    script = shlex.join(stage_argv) + (f" && {shlex.join(verify_argv)}" if verify_argv else "")
    name = f"eagle-{run_id}"
    argv = ["docker", "run", "--detach", "--name", name,
            "--label", f"{LABEL_RUN}={run_id}", "--label", f"{LABEL_STAGE}={stage}",
            "--label", f"{LABEL_OUT}={host_path(host, spec.output)}", "--label", f"{LABEL_HOST}={host.name}",
            *privilege_args(host), "--mount", _mount(host.data_root, DATA), "--mount", _mount(host.cache_dir, CACHE),
            "--env", f"EAGLE_RUN_ID={run_id}", "--env", f"HF_HOME={CACHE}/hf",
            # a writable home for caches (triton, flashinfer, vLLM) on the read-only root file system, and a
            # user name for a uid the image's passwd does not know (getpass.getuser())
            "--env", f"HOME={CACHE}/home", "--env", "USER=eagle-stage"]
    env_dir = None
    if secret_names:
        env_dir = secret_env.env_dir(host.secrets_dir, run_id, env_token or secrets.token_hex(8))
        argv += ["--env-file", f"{env_dir}/{secret_env.ENV_FILE}"]
    if spec.uses_model:
        argv += ["--mount", _mount(host.model_dir, MODEL, readonly=True)]
    if host.docker_gpus:
        argv += ["--gpus", host.docker_gpus]
    for m in host.mounts:
        src, dst, *mode = m.split(":")
        argv += ["--mount", _mount(src, dst, readonly=mode == ["ro"])]
    argv += ["--entrypoint", "/bin/sh", host.image, "-c", script]
    return StagePlan(run_id=run_id, stage=stage, container=name, image=host.image,
                     host_inputs=tuple(host_path(host, p) for p in spec.inputs), host_output=host_path(host, spec.output),
                     stage_argv=stage_argv, verify_argv=verify_argv, docker_run=tuple(argv), resume=resume,
                     secret_names=tuple(secret_names), env_dir=env_dir)


def resolve_user(plan: StagePlan, uid: int, gid: int) -> StagePlan:
    """stage_user "auto": the container runs as the data root's owner (found by the preflight probe), so
    what the stage writes belongs to whoever owns the data."""
    argv = list(plan.docker_run)
    i = argv.index("--user") + 1
    if argv[i] != AUTO_USER:
        return plan
    argv[i] = f"{uid}:{gid}"
    return dataclasses.replace(plan, docker_run=tuple(argv))


def logs_argv(container: str) -> tuple[str, ...]:
    return ("docker", "logs", "--follow", container)


def finish_argvs(container: str) -> tuple[tuple[str, ...], ...]:
    """After the log follow ends: exit code (docker wait), start/finish times, then remove it; run as one
    `&&` chain, the output reads `CODE STARTED FINISHED NAME`."""
    return (("docker", "wait", container),
            ("docker", "inspect", "--format", "{{.State.StartedAt}} {{.State.FinishedAt}}", container),
            ("docker", "rm", "--volumes", container))


def find_argv(run_id: str) -> tuple[str, ...]:
    fmt = "{{.Names}}\t{{.State}}\t{{.Label \"" + LABEL_STAGE + "\"}}\t{{.Label \"" + LABEL_OUT + "\"}}"
    return ("docker", "ps", "--all", "--filter", f"label={LABEL_RUN}={run_id}", "--format", fmt)


def stage_outputs_argv() -> tuple[str, ...]:
    """Every stage container on the host (running or not): name, state, run id, output folder."""
    return ("docker", "ps", "--all", "--filter", f"label={LABEL_RUN}", "--format",
            "{{.Names}}\t{{.State}}\t{{.Label \"" + LABEL_RUN + "\"}}\t{{.Label \"" + LABEL_OUT + "\"}}")


def stage_ids_argv() -> tuple[str, ...]:
    """Running stage containers: full id, run id, name."""
    return ("docker", "ps", "--no-trunc", "--filter", f"label={LABEL_RUN}", "--format",
            "{{.ID}}\t{{.Label \"" + LABEL_RUN + "\"}}\t{{.Names}}")


def abort_argvs(container: str, stop_seconds: float) -> tuple[tuple[str, ...], ...]:
    """After Ctrl-C: stop the stage gracefully, keep its whole log (`docker logs` output), remove it; run
    as `stop && logs; rm`."""
    return (("docker", "stop", "--time", str(int(stop_seconds)), container), ("docker", "logs", container),
            ("docker", "rm", "--force", "--volumes", container))


def stage_containers_argv() -> tuple[str, ...]:
    """Every stage container on the host (running or not): name, state, run id."""
    return ("docker", "ps", "--all", "--filter", f"label={LABEL_RUN}", "--format",
            "{{.Names}}\t{{.State}}\t{{.Label \"" + LABEL_RUN + "\"}}")


def expected_output_bytes(num_tokens: int, hidden_size: int, layers: int = 4, bytes_per_value: int = 2) -> int:
    """Hidden states on disk: samples x tokens (= all tokens) x hidden x 4 layers x 2 bytes (bf16)."""
    return num_tokens * hidden_size * layers * bytes_per_value
