"""The train stage with states produced while the draft trains (`pipeline train --states-mode online|hybrid`)
on one host: the hosts file's `[hosts.NAME.train]` table and the flags it becomes.

Owns the table's grammar (mode, budget, states backend, and how the GPUs are split between the producer of
the states and the trainer: disjoint lists of host GPU indices, or "shared" by both), its validation at the
boundary, and the pure rendering into `pipeline train` flags and container environment, with a
description that `--dry-run` prints. A vllm producer may span several GPUs (tensor parallel over
`producer_gpus`: `--states-tensor-parallel-size`, the engine on the first N GPUs the container sees, the
trainer on the one after them). Several trainer GPUs make the stage a torchrun job (`TrainPlan.launcher`,
pipeline/runtime/torchrun.py: one `pipeline train` process per trainer GPU, speculators' DDP), the trainer
GPUs first in the container's order (rank r on cuda:r) and the producer's after them: the hf producer in
rank 0's process, or the vLLM engine in a process of rank 0's own (pipeline/train/producer_process.py),
tensor parallel over the producer GPUs. With one trainer the vLLM engine is in a process of its own too
(`pipeline train --states-producer auto`). It also refuses, in one line, a split today's `pipeline train`
cannot run (docs/train.md): an hf producer on more than one GPU, a memory share for anything but a vLLM
engine (`--states-memory-share`, pipeline/train/share.py). Pure: the host's GPU count comes from the
preflight's probe (`check_gpu_count`).

Every process this mode starts (the trainer, its producer thread or process, the hf backend in the same
process, the vLLM engine's worker processes, children of it, or torchrun's agent and its trainer processes)
runs inside the one stage container, so gpu-clean knows them by that container's labels
(ops.lock.refuse_killing_stages) like any stage's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from contract.stages import DATA
from ops.errors import ConfigError
from ops.stageargs import StageArgs, last_values

MODES = ("offline", "online", "hybrid")
STATES_BACKENDS = ("hf", "vllm")
SHARED = "shared"
STATES_DIR = f"{DATA}/train_states"  # the states dir the run writes (`--data`): never a finished extract set
# pipeline/train/states.py parse_bytes' grammar (ops never imports pipeline; check-args in the image
# checks the value again before anything is stopped)
_SIZE = re.compile(r"^\s*[0-9]+(?:\.[0-9]+)?\s*(|b|k|kb|m|mb|g|gb|t|tb|kib|mib|gib|tib)\s*$", re.IGNORECASE)
_KEYS = (
    "states_mode",
    "states_budget",
    "states_backend",
    "gpus",
    "producer_gpus",
    "trainer_gpus",
    "memory_share",
    "trainers",
)
# the flags this module renders; an operator's own after `--` wins (theirs go to the stage as given)
FLAGS = (
    "--states-mode",
    "--states-budget",
    "--states-backend",
    "--states-device",
    "--states-tensor-parallel-size",
    "--states-memory-share",
    "--device",
    "--data",
)


@dataclass(frozen=True)
class TrainStates:
    """The `[hosts.NAME.train]` table: offline (the default) trains on a finished extract set as before."""

    states_mode: str = "offline"  #: offline | online | hybrid
    states_budget: str | None = None  #: online/hybrid: bytes of state files on disk at most (500G, 2T)
    states_backend: str = "hf"  #: the producer's extract backend: hf | vllm
    producer_gpus: tuple[int, ...] = ()  #: host GPU indices of the producer (split); () = shared
    trainer_gpus: tuple[int, ...] = ()  #: host GPU indices of the trainer (split); () = shared
    memory_share: float | None = None  #: shared: the producer's share of each GPU's memory, in (0, 1)
    trainers: int = 1  #: shared: trainer processes on cuda:0..trainers-1 (several: torchrun)

    @property
    def produced(self) -> bool:
        return self.states_mode != "offline"

    @property
    def shared(self) -> bool:
        return not self.producer_gpus

    @property
    def trainer_processes(self) -> int:
        """One per trainer GPU: the split's list, or `trainers` on shared GPUs."""
        return self.trainers if self.shared else len(self.trainer_gpus)

    @property
    def data_parallel(self) -> bool:
        """Several trainer processes, one per GPU (torchrun)."""
        return self.trainer_processes > 1

    @property
    def gpus(self) -> tuple[int, ...]:
        """The host GPUs the split names in the container's cuda:0.. order: the producer's first (a vllm
        engine takes the first GPUs it sees), except with several trainer GPUs, whose torchrun ranks take
        cuda:0..N-1: theirs first, then the producer's."""
        if self.data_parallel:
            return (*self.trainer_gpus, *self.producer_gpus)
        return (*self.producer_gpus, *self.trainer_gpus)


def _indices(value: object, key: str, where: str) -> tuple[int, ...]:
    ok = (
        isinstance(value, list)
        and value
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    )
    if not ok or min(value) < 0:
        raise ConfigError(f"{where}: train.{key} must be a non-empty list of GPU indices (0, 1, ...)")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where}: train.{key} {value} names a GPU twice")
    return tuple(value)


def train_from_table(table: object, where: str) -> TrainStates:
    """Validate `[hosts.NAME.train]`; every error is one line naming the key."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: train must be a table")
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown train key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}")
    mode = table.get("states_mode", "offline")
    if mode not in MODES:
        raise ConfigError(f"{where}: train.states_mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "offline":
        extra = sorted(set(table) - {"states_mode"})
        if extra:
            raise ConfigError(
                f"{where}: train.{', train.'.join(extra)}: only with states_mode online or hybrid"
            )
        return TrainStates()
    budget = table.get("states_budget")
    if not isinstance(budget, str) or not _SIZE.match(budget) or not float(re.sub(r"[^0-9.]", "", budget)):
        raise ConfigError(
            f"{where}: train.states_budget must be a size like 500G, 2T or 64GiB (states_mode {mode} holds "
            f"its state files within it), got {budget!r}"
        )
    backend = table.get("states_backend", "hf")
    if backend not in STATES_BACKENDS:
        raise ConfigError(
            f"{where}: train.states_backend must be one of {', '.join(STATES_BACKENDS)}, got {backend!r}"
        )
    gpus = table.get("gpus")
    lists = [k for k in ("producer_gpus", "trainer_gpus") if k in table]
    if gpus is not None and gpus != SHARED:
        raise ConfigError(f'{where}: train.gpus must be "shared" (or give producer_gpus and trainer_gpus)')
    if gpus == SHARED and lists:
        raise ConfigError(f'{where}: train.gpus = "shared" and train.{lists[0]}: give one or the other')
    share = table.get("memory_share")
    if share is not None:
        if gpus != SHARED:
            raise ConfigError(
                f'{where}: train.memory_share is the producer\'s share with gpus = "shared" only'
            )
        if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share < 1:
            raise ConfigError(
                f"{where}: train.memory_share must be a number between 0 and 1 (exclusive), got {share!r}"
            )
        share = float(share)
    trainers = table.get("trainers", 1)
    if not isinstance(trainers, int) or isinstance(trainers, bool) or trainers < 1:
        raise ConfigError(
            f"{where}: train.trainers must be a whole number of trainer processes >= 1, got {trainers!r}"
        )
    if "trainers" in table and lists:
        raise ConfigError(
            f'{where}: train.trainers counts the trainer processes on gpus = "shared"; with '
            "train.trainer_gpus there is one per GPU listed: drop it"
        )
    producer = trainer = ()
    if lists:
        if len(lists) == 1:
            other = "trainer_gpus" if lists[0] == "producer_gpus" else "producer_gpus"
            raise ConfigError(f"{where}: train.{lists[0]} needs train.{other} too")
        producer = _indices(table["producer_gpus"], "producer_gpus", where)
        trainer = _indices(table["trainer_gpus"], "trainer_gpus", where)
        both = sorted(set(producer) & set(trainer))
        if both:
            raise ConfigError(
                f"{where}: train.producer_gpus and train.trainer_gpus share GPU {', '.join(map(str, both))}: "
                'list disjoint GPUs, or set gpus = "shared"'
            )
    return TrainStates(mode, budget.strip(), backend, producer, trainer, share, trainers)


@dataclass(frozen=True)
class TrainPlan:
    """What the host's train table adds to the stage container: `pipeline train` flags, environment, the
    states dir it writes, and the lines `--dry-run` prints (what and why)."""

    states: TrainStates
    flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    data: str
    why: tuple[str, ...]
    launcher: tuple[str, ...] = ("python",)  # the words before `-m pipeline train`: torchrun for several GPUs


def _runnable(ts: TrainStates, docker_gpus: str) -> None:
    """Refuse, in one line, a split that today's `pipeline train` cannot run (docs/train.md)."""
    if ts.memory_share is not None and ts.states_backend != "vllm":
        raise ConfigError(
            f"train.memory_share {ts.memory_share:g}: the share holds a vLLM engine to part of each GPU's "
            f"memory, and the {ts.states_backend} backend produces here; remove it, or set "
            'states_backend = "vllm"'
        )
    if ts.shared:
        return
    if len(ts.producer_gpus) > 1 and ts.states_backend == "hf":
        raise ConfigError(
            f"train.producer_gpus {list(ts.producer_gpus)}: the hf states backend produces on one GPU; "
            'list one, or set states_backend = "vllm" (tensor parallel over them)'
        )
    if docker_gpus not in ("all", ""):
        raise ConfigError(
            f'train.producer_gpus/trainer_gpus are host GPU indices: they need docker_gpus = "all" (the '
            f"container sees the host's numbering), not {docker_gpus!r}"
        )


def plan_train(ts: TrainStates, args: StageArgs, *, docker_gpus: str, container: str) -> TrainPlan | None:
    """The flags and environment of the train stage for the host's table; None for offline (the stage runs
    as before). Flags the operator gave after `--` are left out (theirs reach the stage as given)."""
    if not ts.produced:
        return None
    _runnable(ts, docker_gpus)
    given = last_values(args.argv, FLAGS)
    want: list[tuple[str, str]] = [
        ("--states-mode", ts.states_mode),
        ("--states-budget", ts.states_budget or ""),
        ("--states-backend", ts.states_backend),
    ]
    env: tuple[tuple[str, str], ...] = ()
    launcher: tuple[str, ...] = ("python",)
    n = ts.trainer_processes
    if ts.shared:
        if ts.states_backend == "hf":
            want.append(("--states-device", "cuda:0"))
        if n == 1:  # several: each rank's device is torchrun's local rank
            want.append(("--device", "cuda:0"))
        engine = "the hf producer on cuda:0" + (" (in rank 0's process)" if n > 1 else "")
        if ts.states_backend == "vllm":
            if ts.memory_share is not None:
                want.append(("--states-memory-share", f"{ts.memory_share:g}"))
            share = (
                f"{ts.memory_share:g} of each GPU's memory (hosts file: train.memory_share)"
                if ts.memory_share is not None
                else "pipeline train's share of each GPU's memory (the weights' share + 0.2, within "
                "0.3-0.85; hosts file: train.memory_share)"
            )
            own = ", in a process of rank 0's own" if n > 1 else ", in a process of its own"
            engine = (
                f"the vLLM engine on every GPU the container sees (tensor parallel over all{own}), held to "
                f"{share}"
            )
        trainer = (
            "the trainer on cuda:0 beside it"
            if n == 1
            else f"the trainer data parallel over cuda:0..{n - 1} beside it (torchrun, one process per GPU, "
            "speculators' DDP; rank 0 produces for every rank)"
        )
        split = (
            f"GPUs shared: {engine}, {trainer} (hosts file: train.gpus shared, the default; train.trainers)"
        )
    else:
        visible = ",".join(map(str, ts.gpus))
        env = (("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), ("CUDA_VISIBLE_DEVICES", visible))
        order = (
            f"CUDA_VISIBLE_DEVICES={visible} in PCI bus order (nvidia-smi's and gpu-status's numbering); "
            "hosts file: train.producer_gpus, train.trainer_gpus"
        )
        if ts.data_parallel:
            trainers = ", ".join(map(str, ts.trainer_gpus))
            if ts.states_backend == "hf":
                want.append(("--states-device", f"cuda:{n}"))  # each rank's device: torchrun's local rank
                producer = (
                    f"the hf producer on host GPU {ts.producer_gpus[0]} (cuda:{n} in the container, in rank "
                    "0's process)"
                )
            else:  # rank 0 starts the engine in a process that sees only the GPUs after the trainers'
                tp = len(ts.producer_gpus)
                want.append(("--states-tensor-parallel-size", str(tp)))
                host = ", ".join(map(str, ts.producer_gpus))
                producer = (
                    f"the vLLM engine tensor parallel {tp} on host GPU{'s' if tp > 1 else ''} {host} "
                    f"(cuda:{n}..{n + tp - 1} in the container, in a process of rank 0's own; the model's "
                    f"attention heads must divide by {tp})"
                )
            split = (
                f"GPUs split: {producer}, the trainer data parallel over host GPUs {trainers} "
                f"(cuda:0..{n - 1}: torchrun, one process per GPU, speculators' DDP; rank 0 produces "
                f"for every rank): {order}"
            )
        else:
            tp = len(ts.producer_gpus)
            if ts.states_backend == "hf":
                want.append(("--states-device", "cuda:0"))
                producer = f"the hf producer on host GPU {ts.producer_gpus[0]} (cuda:0 in the container)"
            else:  # the engine's workers take cuda:0..tp-1, the first GPUs the container sees
                want.append(("--states-tensor-parallel-size", str(tp)))
                host = ", ".join(map(str, ts.producer_gpus))
                producer = (
                    f"the vLLM engine tensor parallel {tp} on host GPU{'s' if tp > 1 else ''} {host} "
                    f"(cuda:0..{tp - 1} in the container, in a process of its own; the model's attention "
                    f"heads must divide by {tp})"
                )
            want.append(("--device", f"cuda:{tp}"))
            split = (
                f"GPUs split: {producer}, the trainer on host GPU {ts.trainer_gpus[0]} (cuda:{tp}): {order}"
            )
    if ts.data_parallel:  # one `pipeline train` process per trainer GPU
        launcher = ("python", "-m", "pipeline.runtime.torchrun", "--standalone", "--nproc-per-node", str(n))
    trainer = f"torchrun's agent and its {n} trainer processes" if ts.data_parallel else "the trainer"
    flags = tuple(w for flag, value in want if flag not in given for w in (flag, value))
    mine = [f for f, _ in want if f in given]
    why = (
        f"states: {ts.states_mode}, at most {ts.states_budget} of state files in {STATES_DIR} (written by "
        f"the run, not a finished extract set), produced by the {ts.states_backend} backend while the draft "
        "trains",
        split,
        f"processes: {trainer}, its producer thread or process and any engine worker all run in container "
        f"{container}, labelled with the run id: gpu-clean refuses to kill them while it runs; the server "
        "is stopped before and restored after (--restore-server) as for extract",
        *((f"yours after `--` win: {', '.join(mine)}",) if mine else ()),
    )
    return TrainPlan(ts, flags, env, given.get("--data", STATES_DIR), why, launcher)


def check_gpu_count(ts: TrainStates, gpus: int) -> str | None:
    """Why the split cannot run on a host with `gpus` GPUs (the preflight's probe), or None."""
    if ts.produced and ts.shared and ts.trainers > gpus:
        return f"train.trainers {ts.trainers}: one trainer process per GPU, and the host has {gpus}"
    missing = [i for i in ts.gpus if i >= gpus]
    if not ts.produced or not missing:
        return None
    return (
        f"train.producer_gpus/trainer_gpus name GPU {', '.join(map(str, missing))}, the host has {gpus} "
        f"(0..{gpus - 1})"
    )
