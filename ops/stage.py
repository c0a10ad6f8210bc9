"""Stage container plans: what runs in the image, with which mounts, under which name and labels.

Owns, from the stage table (contract/stages.py: container command, input and output folders under the data
root), the run id, the stage container's privileges (the host's network for a server-up stage alone, which
asks the server on the host's loopback), and the exact `docker run` / `docker logs` / `docker wait` argv.
Pure: running them is ops.remote_run's job. Host paths are passed to docker as data (--mount fields,
CSV-quoted), never interpolated into a shell string unquoted.
"""

from __future__ import annotations

import csv
import io
import secrets
import shlex
import time
from dataclasses import dataclass

from contract.env import IMAGE_DIGEST_ENV
from contract.stages import CACHE, DATA, MODEL, SERVER_STOPPED, SERVER_UP, STAGES, StageSpec
from ops import secret_env
from ops.errors import ConfigError
from ops.hosts import HostConfig, check_label
from ops.layout import Layout, stage_flags
from ops.stageargs import StageArgs, last_values, parse
from ops.trainsplit import TrainPlan, plan_train

LABEL_RUN, LABEL_STAGE, LABEL_OUT, LABEL_HOST = (
    "eagle-ops.run-id",
    "eagle-ops.stage",
    "eagle-ops.output",
    "eagle-ops.host",
)
LABEL_PREFLIGHT = (
    "eagle-ops.preflight"  # a stage's preflight container (not a stage container: no run-id label)
)
AUTO_USER = "auto"  # placeholder until preflight knows the data root's owner (resolve_user)


PREFLIGHT_FLAGS = (
    "--model",
    "--prepared",
    "--out",
    "--backend",
    "--layer-ids",
    "--tensor-parallel-size",
    "--dtype",
)
Shard = tuple[int, int]  # (world size, rank) of one host of a multi-host run


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
    args: StageArgs = StageArgs()  # the operator's arguments after `--`, read once (ops.stageargs.parse)
    shard: Shard | None = (
        None  # multi-host: this host's (world size, rank), rendered after the operator's words
    )
    layout: Layout | None = None  # resolved parallel layout (layout stages); None: not yet resolved
    preflight_run: tuple[str, ...] = ()  # `docker run --rm` of the stage's preflight (preflight_script)
    user: str = AUTO_USER  # the container's --user: "UID:GID", or AUTO_USER until the probe knows the owner
    image_digest: str | None = (
        None  # told to the stage container (IMAGE_DIGEST_ENV) once the preflight knows it
    )
    # the checkpoint's weight bytes on the host, once the preflight has read them (the layout's backend rule)
    model_weights_bytes: int | None = None
    # its MoE's (k, E) routed experts from the config.json the preflight read; (0, 0): dense or not read
    model_experts: tuple[int, int] = (0, 0)
    # what a quantized checkpoint's experts gain when hf dequantizes them (contract/experts.py); 0: none
    model_dequantized_extra: int = 0
    train: TrainPlan | None = (
        None  # train with states produced while it trains (the hosts file's train table)
    )

    @property
    def server_up(self) -> bool:
        """The stage asks the host's running server (contract.stages.SERVER_UP): never stopped, no gpu-clean,
        nothing restored."""
        return STAGES[self.stage].server == SERVER_UP

    @property
    def stops_server(self) -> bool:
        """The stage needs the GPUs free (contract.stages.SERVER_STOPPED): ops stops the server, proves the
        GPUs clean, and restores it on --restore-server. regenerate (server up), prepare and weights (server
        kept: no GPU, no server) leave it running."""
        return STAGES[self.stage].server == SERVER_STOPPED

    @property
    def extra_args(self) -> tuple[str, ...]:
        """The operator's words after `--`, as given (without a multi-host run's shard flags)."""
        return self.args.argv

    @property
    def dtype(self) -> str | None:
        """The stored states' --dtype as the operator gave it (None: the stage's auto)."""
        return self.args.dtype

    @property
    def world_size(self) -> int:
        """Hosts sharing this stage: the multi-host run's, else the operator's --world-size, else 1."""
        return self.shard[0] if self.shard else max(1, self.args.world_size or 1)


def host_path(host: HostConfig, rel: str) -> str:
    return f"{host.data_root.rstrip('/')}/{rel}"


def _mount(src: str, dst: str, readonly: bool = False) -> str:
    """One --mount value; fields are CSV, so a path with commas or quotes is quoted, not split."""
    buf = io.StringIO()
    fields = ["type=bind", f"source={src}", f"target={dst}"] + (["readonly"] if readonly else [])
    csv.writer(buf, lineterminator="").writerow(fields)
    return buf.getvalue()


def default_user(host: HostConfig) -> str:
    """The hosts file's stage_user as docker's --user: "root" is 0:0, "auto" waits for the probe."""
    return {"auto": AUTO_USER, "root": "0:0"}.get(host.stage_user, host.stage_user)


def privilege_args(host: HostConfig, user: str | None = None) -> list[str]:
    """Least privilege the GPU stack allows (docs/ops.md, "Stage container privileges"): no capability,
    no privilege gain through setuid files, a process/thread cap, read-only root file system with a
    private /tmp, a non-root user when the data root's owner is one, a private IPC namespace with a
    sized /dev/shm (NCCL and vLLM's message queues need shared memory, not the host's IPC namespace).
    GPUs come only through --gpus (device requests); never --privileged."""
    argv = ["--user", user or default_user(host), "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    if host.stage_pids_limit:
        argv += ["--pids-limit", str(host.stage_pids_limit)]
    if host.stage_read_only:
        argv += ["--read-only", "--tmpfs", "/tmp:rw,exec,nosuid,nodev,mode=1777"]
    argv += (
        ["--ipc", "host"]
        if host.stage_ipc == "host"
        else ["--ipc", "private", "--shm-size", host.stage_shm_size]
    )
    return argv


CACHE_ENV = (
    ("HF_HOME", f"{CACHE}/hf"),
    ("HOME", f"{CACHE}/home"),
    ("TORCHINDUCTOR_CACHE_DIR", f"{CACHE}/torchinductor"),
    # vLLM's compile cache (its default, ~/.cache/vllm, lands in HOME above too; named so that it is seen):
    # the vllm backend's cold compile put the first batch at 185 s on the H200, a warm one at 32 s
    ("VLLM_CACHE_ROOT", f"{CACHE}/vllm"),
)


def container_env(run_id: str) -> tuple[tuple[str, str], ...]:
    """The stage container's environment (besides secrets): run id, HF cache, a writable home for caches
    (triton, flashinfer, vLLM) on the read-only root file system, torch inductor's cache beside them (its
    default is under /tmp, a tmpfs per run: the hf backend's compile took ~8 s cold and ~3.5 s from a warm
    cache on the H200, docs/benchmarks-history.md), and a user name for a uid the image's passwd does not know
    (getpass.getuser())."""
    return (
        ("EAGLE_RUN_ID", run_id),
        *CACHE_ENV,
        ("USER", "eagle-stage"),
    )


def stage_mounts(host: HostConfig, spec: StageSpec) -> list[tuple[str, str, bool]]:
    """(host path, container path, read-only) of the stage container: data, cache, model, extra mounts."""
    mounts = [(host.data_root, DATA, False), (host.cache_dir, CACHE, False)]
    if spec.uses_model:
        mounts.append((host.model_dir, MODEL, True))
    for m in host.mounts:
        src, dst, *mode = m.split(":")
        mounts.append((src, dst, mode == ["ro"]))
    return mounts


def _container_args(
    host: HostConfig,
    spec: StageSpec,
    run_id: str,
    user: str,
    env_file: str | None = None,
    env: tuple[tuple[str, str], ...] = (),
) -> list[str]:
    """Everything of `docker run` the stage and its preflight share: privileges, environment (`env`: the
    stage's own, e.g. the train split's CUDA_VISIBLE_DEVICES), mounts, GPUs (the stage alone also gets the
    secrets' env file)."""
    argv = privilege_args(host, user)
    if spec.server == SERVER_UP:  # the server listens on the host's loopback (docs/ops.md, privileges)
        argv += ["--network", "host"]
    mounts = stage_mounts(host, spec)
    for src, dst, ro in mounts[:2]:
        argv += ["--mount", _mount(src, dst, ro)]
    for name, value in (*container_env(run_id), *env):
        argv += ["--env", f"{name}={value}"]
    if env_file:
        argv += ["--env-file", env_file]
    tail: list[str] = []
    for src, dst, ro in mounts[2:]:
        tail += ["--mount", _mount(src, dst, ro)]
    if (
        spec.uses_model
    ):  # the model mount, then GPUs, then the hosts file's mounts (the argv's historic order)
        argv += tail[:2]
        tail = tail[2:]
    if host.docker_gpus and spec.gpus:
        argv += ["--gpus", host.docker_gpus]
    return argv + tail


def server_flags(host: HostConfig, args: StageArgs = StageArgs()) -> tuple[str, ...]:
    """A server-up stage's flags for the host's server (hosts file: server_endpoint, served_model), leaving
    out those the operator gave after `--` (their words stay in args.argv, which the stage gets as given)."""
    out: list[str] = []
    if args.endpoint is None:
        out += ["--endpoint", host.server_endpoint]
    if host.served_model is not None and args.served_model is None:
        out += ["--served-model", host.served_model]
    return tuple(out)


def stage_arguments(stage_argv: tuple[str, ...]) -> tuple[str, ...]:
    """The words after `-m pipeline STAGE` of a stage's argv, whatever launches it (python, or the
    data-parallel launcher `python -m pipeline.runtime.torchrun ...`)."""
    at = next(i for i in range(len(stage_argv) - 1) if stage_argv[i : i + 2] == ("-m", "pipeline"))
    return stage_argv[at + 3 :]


def preflight_script(stage: str, stage_argv: tuple[str, ...]) -> str:
    """The one process the preflight container runs. Prepare and extract: `pipeline preflight` with the
    stage's own values, failing fast on the checks the stage refuses on (its StageSpec.fatal; every check
    for extract), then STAGE ARGS, the exact stage argv, which it checks first as `pipeline check-args`
    does; a refusal found by reading files (arguments, config, checkpoint headers, layer ids, data, disk)
    then costs no torch, transformers or vLLM import. "check" (regenerate): the stage's own `--check` of the
    exact argv (inputs, output folder, the server it asks), which writes nothing. Other stages: `pipeline
    check-args` of the argv."""
    spec = STAGES[stage]
    args = stage_arguments(stage_argv)
    if spec.preflight == "check":
        return shlex.join(("python", "-m", "pipeline", stage, *args, "--check"))
    if spec.preflight not in ("model", "extract"):
        return shlex.join(("python", "-m", "pipeline", "check-args", stage, *args))
    pf = ["python", "-m", "pipeline", "preflight"]
    flags = PREFLIGHT_FLAGS if spec.preflight == "extract" else ("--model",)
    values = last_values(args, flags, where="in the stage's arguments")
    for flag in flags:
        if flag in values:
            pf += [flag, values[flag]]
    if spec.preflight == "model":
        pf += ["--backend", "hf"]  # prepare loads no model: its tokenizer and config matter, not vLLM
    if "--trust-remote-code" in args:
        pf.append("--trust-remote-code")
    if spec.preflight == "extract" and "--expert-parallel" in args:
        pf.append("--expert-parallel")  # refused there, before the server stops, for hf or a dense model
    pf += ["--fail-fast-on", ",".join(spec.fatal) or "any"]
    return shlex.join((*pf, "--", stage, *args))


def plan_stage(
    host: HostConfig,
    stage: str,
    *,
    run_id: str,
    extra_args: tuple[str, ...] | StageArgs = (),
    shard: Shard | None = None,
    resume: bool = False,
    secret_names: tuple[str, ...] = (),
    env_token: str | None = None,
    layout: Layout | None = None,
    env_dir: str | None = None,
    user: str | None = None,
    image_digest: str | None = None,
) -> StagePlan:
    """`extra_args`: the operator's words after `--` (read here, once, unless already a StageArgs); `shard`:
    a multi-host run's (world size, rank). `secret_names`: variables (set on the operator's machine) that
    reach the container through the env file; `env_token` names its directory (random by default;
    `env_dir` keeps an earlier plan's).
    `layout`: the resolved parallel layout of a layout stage (ops.layout.resolve); without it the
    stage's argv carries no layout flags yet (a dry run shows what auto becomes). `user` (default: the
    hosts file's) and `image_digest` are fields the preflight fills in (replan); the argv is rendered
    from the fields, never edited. A server-up stage (regenerate) gets the hosts file's server endpoint and
    model name (server_flags) and the host's network. The train stage also takes the hosts file's train table
    (ops.trainsplit.plan_train: states flags, the states dir as --data, the GPU split's environment)."""
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")
    spec = STAGES[stage]
    check_run_id(run_id)
    args = extra_args if isinstance(extra_args, StageArgs) else parse(extra_args)
    name = f"eagle-{run_id}"
    flags = stage_flags(layout, args) if spec.layout and layout is not None else ()
    if spec.server == SERVER_UP:
        flags = server_flags(host, args)
    train = (
        plan_train(host.train, args, docker_gpus=host.docker_gpus, container=name)
        if stage == "train"
        else None
    )
    spec_args, inputs = spec.args, spec.inputs
    if train is not None:  # the run writes its own states dir: no finished extract set is read
        at = spec_args.index("--data") + 1
        spec_args = (*spec_args[:at], train.data, *spec_args[at + 1 :])
        inputs = tuple(p for p in inputs if p != "hidden_states")
        flags = train.flags
    shard_flags = ("--world-size", str(shard[0]), "--rank", str(shard[1])) if shard else ()
    stage_argv = (
        *(train.launcher if train is not None else ("python",)),
        "-m",
        "pipeline",
        stage,
        *spec_args,
        *flags,
        *(("--resume",) if resume and stage in ("extract", "train") else ()),
        *args.argv,
        *shard_flags,
    )
    verify_argv = (
        ("python", "-m", "pipeline", "verify", f"{DATA}/{spec.output}") if spec.verify_after else None
    )
    script = shlex.join(stage_argv) + (f" && {shlex.join(verify_argv)}" if verify_argv else "")
    env = train.env if train is not None else ()
    if secret_names:
        env_dir = env_dir or secret_env.env_dir(host.secrets_dir, run_id, env_token or secrets.token_hex(8))
    else:
        env_dir = None
    env_file = f"{env_dir}/{secret_env.ENV_FILE}" if env_dir else None
    user = user or default_user(host)
    digest_env = ("--env", f"{IMAGE_DIGEST_ENV}={image_digest}") if image_digest else ()
    argv = (
        "docker",
        "run",
        "--detach",
        "--name",
        name,
        "--label",
        f"{LABEL_RUN}={run_id}",
        "--label",
        f"{LABEL_STAGE}={stage}",
        "--label",
        f"{LABEL_OUT}={host_path(host, spec.output)}",
        "--label",
        f"{LABEL_HOST}={host.name}",
        *_container_args(host, spec, run_id, user, env_file, env),
        "--entrypoint",
        "/bin/sh",
        *digest_env,
        host.image,
        "-c",
        script,
    )
    common = _container_args(host, spec, run_id, user, env=env)
    # the preflight: the same user, mounts, environment and GPUs, removed when it exits, never counted as a
    # stage container (no run-id label), no secrets (it reads local files only)
    preflight_run = (
        "docker",
        "run",
        "--rm",
        "--name",
        f"{name}-preflight",
        "--label",
        f"{LABEL_PREFLIGHT}={run_id}",
        *common,
        "--entrypoint",
        "/bin/sh",
        host.image,
        "-c",
        preflight_script(stage, stage_argv),
    )
    return StagePlan(
        run_id=run_id,
        stage=stage,
        container=name,
        image=host.image,
        host_inputs=tuple(host_path(host, p) for p in inputs),
        host_output=host_path(host, spec.output),
        stage_argv=stage_argv,
        verify_argv=verify_argv,
        docker_run=argv,
        resume=resume,
        secret_names=tuple(secret_names),
        env_dir=env_dir,
        args=args,
        shard=shard,
        layout=layout if spec.layout else None,
        preflight_run=preflight_run,
        user=user,
        image_digest=image_digest,
        train=train,
    )


def replan(host: HostConfig, plan: StagePlan, **fields) -> StagePlan:
    """The same plan (run id, arguments, secrets, env directory, layout, user, digest) with ``fields``
    changed, rendered again from its fields."""
    keep = dict(
        run_id=plan.run_id,
        extra_args=plan.args,
        shard=plan.shard,
        resume=plan.resume,
        secret_names=plan.secret_names,
        layout=plan.layout,
        env_dir=plan.env_dir,
        user=plan.user,
        image_digest=plan.image_digest,
    )
    return plan_stage(host, plan.stage, **{**keep, **fields})


def with_layout(host: HostConfig, plan: StagePlan, layout: Layout) -> StagePlan:
    """The same plan with the layout's flags."""
    return replan(host, plan, layout=layout)


def resolve_user(host: HostConfig, plan: StagePlan, uid: int, gid: int) -> StagePlan:
    """stage_user "auto": the container runs as the data root's owner (found by the preflight probe), so
    what the stage writes belongs to whoever owns the data. An explicit user stays."""
    return replan(host, plan, user=f"{uid}:{gid}") if plan.user == AUTO_USER else plan


def with_image_digest(host: HostConfig, plan: StagePlan, digest: str | None) -> StagePlan:
    """The stage container is told the digest of the image it runs in (``IMAGE_DIGEST_ENV``), which the
    pipeline records in every output's provenance; nothing changes when the digest is unknown."""
    return replan(host, plan, image_digest=digest) if digest else plan


def logs_argv(container: str) -> tuple[str, ...]:
    return ("docker", "logs", "--follow", container)


def finish_argvs(container: str) -> tuple[tuple[str, ...], ...]:
    """After the log follow ends: exit code (docker wait), start/finish times, then remove it; run as one
    `&&` chain, the output reads `CODE STARTED FINISHED NAME`."""
    return (
        ("docker", "wait", container),
        ("docker", "inspect", "--format", "{{.State.StartedAt}} {{.State.FinishedAt}}", container),
        ("docker", "rm", "--volumes", container),
    )


def abort_argvs(container: str, stop_seconds: float) -> tuple[tuple[str, ...], ...]:
    """After Ctrl-C: stop the stage gracefully, keep its whole log (`docker logs` output), remove it; run
    as `stop && logs; rm`."""
    return (
        ("docker", "stop", "--time", str(int(stop_seconds)), container),
        ("docker", "logs", container),
        ("docker", "rm", "--force", "--volumes", container),
    )
