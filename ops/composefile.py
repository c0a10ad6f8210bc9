"""compose.yaml, rendered from the stage table (contract/stages.py): both run the same stages alike.

Owns the text of compose.yaml: the inference server and one service per pipeline stage (plus the extract
preflight), each with the command, mounts, environment and GPUs of the stage table (STAGES,
stage_mounts, CACHE_ENV, privilege defaults). `python -m ops.composefile --write` rewrites the file;
tests/ops/test_ops_compose.py fails when the committed file and this rendering (or ops' plans) differ.
Compose cannot look into the image, so extract's backend is `${EXTRACT_BACKEND:-vllm}` (the project's
image has vLLM) and tensor parallelism is the pipeline's default, all visible GPUs: what ops resolves
for the reference host. What compose leaves to the operator: `<STAGE>_ARGS`, the stage user, and the
`pipeline verify` ops runs after weights and train.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ops.hosts import HostConfig
from contract.stages import SERVER_UP
from ops.stage import CACHE, CACHE_ENV, DATA, MODEL, STAGES, stage_mounts

COMPOSE_FILE = Path(__file__).resolve().parents[1] / "compose.yaml"
HOST_DIRS = {
    DATA: "${EAGLE_DATA_DIR:-./data}",
    CACHE: "${HF_CACHE_DIR:-./cache}",
    MODEL: "${EAGLE_MODEL_DIR:-./models/target}",
}
EXTRACT_BACKEND = "${EXTRACT_BACKEND:-vllm}"
# a server-up stage asks the server service on the host's network, at the port it publishes there
SERVER_ENDPOINT = "http://127.0.0.1:${SERVE_PORT:-8000}/v1"

HEADER = """\
# GENERATED from ops/stage.py's stage table by `python -m ops.composefile --write` (make compose-file):
# edit the table or ops/composefile.py, not this file (tests/ops/test_ops_compose.py checks they agree).
#
# The inference server and one service per pipeline stage, all on the one image (`make image`).
#
#   docker compose up -d vllm-server                      # the server (no profile: `up` starts it alone)
#   docker compose --profile extract run --rm extract     # one stage; its flags come from env, see below
#   EXTRACT_ARGS="--limit 100 --resume" docker compose --profile extract run --rm extract
#
# ops finds the server as `compose:eagle-ops/vllm-server` through the labels compose adds
# (com.docker.compose.project / com.docker.compose.service); `eagle-ops.role=server` marks it too.
# Mounts and folders are ops' own (docs/ops.md): model -> /model (read-only), data -> /data (regenerated/,
# prepared/, hidden_states/, verifier/, train/, evaluate/), cache -> /cache (HF_HOME=/cache/hf,
# HOME=/cache/home, TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor, VLLM_CACHE_ROOT=/cache/vllm).
# Host paths and arguments come from the environment (or an .env file next to this one):
#   EAGLE_OPS_IMAGE   image to run                    (default eagle-ops:latest)
#   EAGLE_MODEL_DIR   target model on the host         -> /model (read-only)
#   EAGLE_DATA_DIR    working data on the host         -> /data
#   HF_CACHE_DIR      cache folder on the host         -> /cache
#   EAGLE_MEMLOCK     locked-memory limit in bytes      (default -1, unlimited)
#   EXTRACT_BACKEND   extract's backend (default vllm; ops picks it per host: hosts-file `backend`)
#   <STAGE>_ARGS      extra flags appended to a stage's command (`python -m pipeline <stage> --help`)
#   SERVE_MODEL, SERVE_PORT, SERVE_TP, SERVE_ARGS    the server's model path, port, tensor parallel, flags
# ops runs `pipeline verify` after weights and train; with compose, run the verify service.
# regenerate asks the running vllm-server (never stopped for it) on the host's network, as ops runs it:
#   docker compose --profile regenerate run --rm regenerate   # REGENERATE_ARGS="--served-model NAME ..."
name: eagle-ops
"""

ANCHORS = """
x-image: &image
  image: ${EAGLE_OPS_IMAGE:-eagle-ops:latest}
  init: true           # a PID 1 that forwards SIGTERM and reaps re-parented vLLM workers
  ulimits:             # NVIDIA's recommended limits for NCCL; EAGLE_MEMLOCK lowers memlock where the
    memlock: ${EAGLE_MEMLOCK:--1}   # container engine may not raise it (-1 = unlimited)
    stack: 67108864
  environment:
%(env)s    HF_HUB_OFFLINE: ${HF_HUB_OFFLINE:-1}
    VLLM_WORKER_MULTIPROC_METHOD: spawn

x-gpus: &gpus
  deploy:
    resources:
      reservations:
        devices:
          - driver: nvidia
            count: all
            capabilities: [gpu]

x-stage: &stage      # ops' stage container privileges (ops/stage.py privilege_args, hosts-file defaults)
  <<: [*image]
  restart: "no"        # a stage runs once; ops (or the operator) decides about re-runs
  working_dir: /data
  cap_drop: [ALL]
  security_opt: [no-new-privileges:true]
  read_only: true
  tmpfs: ["/tmp:rw,exec,nosuid,nodev,mode=1777"]
  pids_limit: %(pids)d
  ipc: private         # NCCL and vLLM's message queues: a private /dev/shm of this size
  shm_size: %(shm)s
"""

SERVER = """
services:
  vllm-server:
    <<: [*image, *gpus]
    ipc: host            # NCCL and vLLM's workers share memory through /dev/shm
    command: >-
      vllm serve ${SERVE_MODEL:-%(model)s}
      --host 0.0.0.0 --port 8000
      --tensor-parallel-size ${SERVE_TP:-8}
      ${SERVE_ARGS:-}
    ports:
      - "${SERVE_PORT:-8000}:8000"
    volumes:
%(volumes)s    restart: unless-stopped   # ops stops it with `docker stop`, brings it back with `docker start`
    stop_grace_period: 120s   # vLLM shuts its workers down on SIGTERM; SIGKILL only after this
    healthcheck:
      test: ["CMD", "python", "-c",
             "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5)"]
      interval: 30s
      timeout: 10s
      retries: 3
      start_period: 40m       # a Kimi-K2.5-sized load takes ~18 min; unhealthy only after this
    labels:
      eagle-ops.role: server
"""


def _volumes(mounts: list[tuple[str, str, bool]]) -> str:
    return "".join(f"      - {HOST_DIRS[dst]}:{dst}{':ro' if ro else ''}\n" for _, dst, ro in mounts)


def stage_command(stage: str) -> list[str]:
    """The service's command words: the table's argv, compose variables where the table names them, the
    layout compose can express (extract's backend), then `${STAGE_ARGS:-}`."""
    spec = STAGES[stage]
    subst = {word: f"${{{var}:-{default}}}" for word, var, default in spec.compose_vars}
    words = ["python", "-m", "pipeline", stage, *(subst.get(w, w) for w in spec.args)]
    if spec.layout:
        words += ["--backend", EXTRACT_BACKEND]
    if spec.server == SERVER_UP:
        words += ["--endpoint", SERVER_ENDPOINT]
    return [*words, f"${{{stage.upper()}_ARGS:-}}"]


def preflight_command() -> list[str]:
    """The extract preflight with extract's own paths and backend (what ops runs before remote-extract)."""
    args = STAGES["extract"].args
    values = {flag: args[args.index(flag) + 1] for flag in ("--model", "--prepared", "--out")}
    return [
        "python",
        "-m",
        "pipeline",
        "preflight",
        *(w for kv in values.items() for w in kv),
        "--backend",
        EXTRACT_BACKEND,
        "--json",
        f"{DATA}/preflight.json",
        "${PREFLIGHT_ARGS:-}",
    ]


def _service(
    name: str,
    command: list[str],
    gpus: bool,
    mounts: list[tuple[str, str, bool]],
    stage: str,
    host_network: bool = False,
) -> str:
    lines = [
        f"  {name}:",
        f"    <<: [*stage{', *gpus' if gpus else ''}]",
        f"    profiles: [{name}]",
        *(["    network_mode: host   # asks the server on the host's loopback"] if host_network else []),
        "    command: >-",
        *_wrap(command),
        "    volumes:",
    ]
    return (
        "\n".join(lines)
        + "\n"
        + _volumes(mounts)
        + (f"    labels:\n      eagle-ops.role: stage\n      eagle-ops.stage: {stage}\n")
    )


def _wrap(words: list[str], width: int = 100) -> list[str]:
    out, line = [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            out.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    return [f"      {x}" for x in [*out, line]]


def render() -> str:
    host = HostConfig(name="compose", host="local")  # the hosts-file defaults: mounts and privileges
    env = "".join(f"    {k}: {v}\n" for k, v in CACHE_ENV)  # run id and USER: ops' own
    text = HEADER + ANCHORS % {"env": env, "pids": host.stage_pids_limit, "shm": host.stage_shm_size}
    text += SERVER % {"model": MODEL, "volumes": _volumes(stage_mounts(host, STAGES["extract"]))}
    extract = STAGES["extract"]
    text += "\n" + _service(
        "preflight", preflight_command(), extract.gpus, stage_mounts(host, extract), "preflight"
    )
    for stage, spec in STAGES.items():
        up = spec.server == SERVER_UP
        text += "\n" + _service(stage, stage_command(stage), spec.gpus, stage_mounts(host, spec), stage, up)
    return text


def main(argv: list[str]) -> int:
    """`--write`: rewrite compose.yaml (temp name, then rename); `--check`: exit 1 when it differs."""
    text = render()
    if argv == ["--write"]:
        tmp = COMPOSE_FILE.with_suffix(".yaml.tmp")
        tmp.write_text(text)
        tmp.replace(COMPOSE_FILE)
        return 0
    if argv == ["--check"]:
        if COMPOSE_FILE.read_text() != text:
            print(
                f"error: {COMPOSE_FILE} differs from the stage table; "
                "run `python -m ops.composefile --write`",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
