"""What the tests of ``--states-mode online|hybrid`` share, whichever backend produces (tests/train/
test_states.py: hf; tests/vllm/test_train_states_vllm.py: vllm): the tiny prepared set and verifier, the run's
config and command line, a budget well under the set, a sampler of the bytes on disk, and a trainer process
signalled mid-run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline.ondisk import formats
from pipeline.train import states
from pipeline.train.config import TrainConfig
from pipeline.train.files import read_metrics
from tests.conftest import REPO

RANKS = 2  # the torchrun jobs' processes
SAMPLES = 16  # prepared samples: 12 train, 4 held out
MAX_LEN = 256
EPOCHS = 2


def make_stage_inputs(root: Path, tiny_llama: Path, conversations: Path) -> dict:
    """prepare (full vocab as draft vocab, --seq-length 128) and weights for the tiny Llama; the first
    SAMPLES samples."""
    from pipeline import prepare, weights

    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    full = root / "full"
    prepare.run(
        prepare.PrepareConfig(
            data=conversations, model=tiny_llama, out=full, seq_length=128, draft_vocab_size=vocab
        )
    )
    samples, meta = formats.read_prepared(full)
    rows = [(samples.ids(i).tolist(), samples.mask(i).tolist()) for i in range(SAMPLES)]
    part = formats.PreparedSamples.from_rows(rows)
    meta.num_samples, meta.num_tokens = SAMPLES, int(part.offsets[-1])
    formats.write_prepared(root / "prepared", part, meta)
    for name in (formats.D2T, formats.T2D, formats.TOKEN_FREQ):
        (root / "prepared" / name).write_bytes((full / name).read_bytes())
    weights.run(tiny_llama, root / "verifier")
    return {"prepared": root / "prepared", "verifier": root / "verifier", "model": tiny_llama}


def extract_per_sample(inputs: dict, out: Path) -> None:
    """``pipeline extract`` of the inputs' prepared set on the CPU, one sample per forward (as the online
    producer writes them, so that offline and produced runs read the same bytes)."""
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.stage import run as extract_run

    extract_run(
        ExtractConfig(
            prepared=inputs["prepared"],
            model=inputs["model"],
            out=out,
            device="cpu",
            max_batch_size=1,
            verify=False,
            progress=False,
        )
    )


def states_config(inputs: dict, data: Path, out: Path, **overrides) -> TrainConfig:
    """The tests' train config: 2 epochs of the 12 training samples on the CPU; ``overrides`` win."""
    base = dict(
        data=data,
        verifier=inputs["verifier"],
        out=out,
        prepared=inputs["prepared"],
        model=inputs["model"],
        epochs=EPOCHS,
        lr=3e-3,
        max_len=MAX_LEN,
        eval_fraction=0.25,
        eval_max_samples=4,
        plots=False,
        device="cpu",
        num_workers=0,
    )
    base.update(overrides)
    return TrainConfig(**base)


def cli_args(cfg: TrainConfig) -> list[str]:
    """``pipeline train`` words for ``cfg`` (the fields these tests set), without evaluation or plots."""
    args = ["train"]
    for flag, value in (
        ("--data", cfg.data),
        ("--verifier", cfg.verifier),
        ("--out", cfg.out),
        ("--prepared", cfg.prepared),
        ("--model", cfg.model),
        ("--epochs", cfg.epochs),
        ("--lr", cfg.lr),
        ("--max-len", cfg.max_len),
        ("--eval-fraction", cfg.eval_fraction),
        ("--eval-max-samples", cfg.eval_max_samples),
        ("--device", cfg.device),
        ("--states-device", None if cfg.states_device == "auto" else cfg.states_device),
        ("--num-workers", cfg.num_workers),
        ("--states-mode", cfg.states_mode),
        ("--states-budget", cfg.states_budget),
        ("--states-backend", None if cfg.states_backend == "auto" else cfg.states_backend),
        ("--states-dtype", None if cfg.states_dtype == "auto" else cfg.states_dtype),
        ("--states-max-batch-size", cfg.states_max_batch_size),
        ("--states-tensor-parallel-size", cfg.states_tensor_parallel_size),
        ("--states-producer", None if cfg.states_producer == "auto" else cfg.states_producer),
        ("--checkpoint-steps", cfg.checkpoint_steps),
    ):
        if value is not None:
            args += [flag, str(value)]
    return [*args, "--no-eval", "--no-plots"]


def budget_for(offline_states: Path, held: int, extra: int = 0) -> str:
    """A budget holding the ``held`` largest files and two more of the largest, plus ``extra`` bytes: much
    less than the set."""
    sizes = sorted(p.stat().st_size for p in offline_states.glob("data_*.pt"))
    return str(sum(sizes[-held:]) + 2 * sizes[-1] + 2 * states.FILE_OVERHEAD + extra)


def checkpoint_weights(out: Path, epoch: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / str(epoch) / "model.safetensors"))


def train_losses(out: Path) -> list[float]:
    return [r["train"]["loss"] for r in read_metrics(out / "metrics.jsonl") if "train" in r]


def train_rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "train" in r]


class Watch:
    """Calls ``sample()`` on a thread every ``interval`` seconds while it is entered (subclasses keep what
    they sample)."""

    interval = 0.005

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class BytesWatch(Watch):
    """Samples ``states.state_file_bytes(directory)`` every 5 ms while it is entered; ``seen`` holds every
    figure, ``max`` the largest."""

    def __init__(self, directory: Path):
        super().__init__()
        self.directory, self.seen = Path(directory), [0]

    def sample(self) -> None:
        if self.directory.is_dir():
            try:
                self.seen.append(states.state_file_bytes(self.directory))
            except OSError:
                pass

    @property
    def max(self) -> int:
        return max(self.seen)


def pipeline_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def signal_after_steps(
    argv: list[str],
    out: Path,
    steps: int,
    sig: int = signal.SIGKILL,
    timeout: float = 300,
    module: str = "pipeline",
    hold: bool = False,
) -> tuple[subprocess.Popen, int, list[int]]:
    """Start ``argv`` (a ``python -m MODULE train`` run writing to ``out``), send ``sig`` to that process
    alone once metrics.jsonl holds ``steps`` training rows, and wait for it to end. With ``hold`` (a MODULE
    that reads tests/train/held_train.py's HOLD) the process stops itself at that row, is
    signalled stopped, then continued, so that the signal lands at that step however loaded the machine.
    Returns the process (its stderr read into ``proc.stderr_text``), the rows seen at the signal, and the
    pids of the process's descendants just before it (an engine's processes)."""
    import psutil

    from tests.train.held_train import HOLD

    err = tempfile.TemporaryFile("w+")  # not a pipe: a child that outlives the process would hold it open
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *argv],
        cwd=REPO,
        env={**pipeline_env(), **({HOLD: str(steps)} if hold else {})},
        stdout=subprocess.DEVNULL,
        stderr=err,
        text=True,
        start_new_session=True,  # a Ctrl-C of the test's terminal does not reach it; only `sig` does
    )
    rows = rows_seen(proc, out, steps, timeout)
    if hold:  # the row is written just before the process stops itself: wait for the stop
        deadline = time.monotonic() + 60
        while proc.poll() is None and psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, f"the process did not stop itself at {steps} rows"
            time.sleep(0.01)
        rows = len(train_rows(out))
    try:
        children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        children = []
    proc.send_signal(sig)
    if hold:
        proc.send_signal(signal.SIGCONT)  # a caught signal (SIGINT) is handled once the process runs again
    proc.wait(timeout=timeout)
    err.seek(0)
    proc.stderr_text = err.read()
    err.close()
    return proc, rows, children


def rows_seen(proc: subprocess.Popen, out: Path, rows: int, timeout: float) -> int:
    """Wait until ``out``'s metrics.jsonl holds ``rows`` training rows, ``proc`` ends or ``timeout``
    seconds pass; return the rows seen."""
    deadline, seen = time.monotonic() + timeout, 0
    while proc.poll() is None and time.monotonic() < deadline and seen < rows:
        time.sleep(0.01)
        seen = len(train_rows(out)) if (out / "metrics.jsonl").is_file() else 0
    return seen


def still_alive(pids: list[int], within: float = 0.0) -> list[int]:
    """The ``pids`` still running (zombies are not) after waiting up to ``within`` seconds for them to go."""
    import psutil

    deadline = time.monotonic() + within
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def committed_step(out: Path) -> tuple[int, int]:
    """The last checkpoint's (global step, local step): where a resume starts (after it settles what a kill
    cut short, as the resume does)."""
    from pipeline.train.trainer import last_epoch, settle_checkpoints

    settle_checkpoints(out)

    state = json.loads((out / "checkpoints" / str(last_epoch(out)) / "training_state.json").read_text())
    return state["global_step"], state["local_step"]


def interrupt_then_resume(
    cfg: TrainConfig,
    stops: list[tuple[int, int]],
    timeout: float = 600,
    module: str = "pipeline",
    hold: bool = False,
) -> dict:
    """Run ``cfg`` as a `python -m MODULE train` process (MODULE: pipeline, or a wrapper of it), signalled
    at each ``(signal, training rows seen)`` of ``stops`` in turn (each run after the first with
    ``--resume``), then once more with ``--resume`` to the end, the state files' bytes sampled throughout.
    After each signal: every state file on disk is complete (written under a temp name). Returns the
    interruptions (signal, process, rows, its descendants' pids, the checkpointed global step, when, the
    kept files' mtimes, the names in the states dir), the last run and the largest bytes seen."""
    argv = cli_args(cfg)
    stopped = []
    with BytesWatch(cfg.data) as watch:
        for n, (sig, rows_at) in enumerate(stops):
            proc, rows, children = signal_after_steps(
                [*argv, *(["--resume"] if n else [])], cfg.out, rows_at, sig, timeout, module, hold
            )
            when = time.time()
            for i in formats.existing_data_indices(cfg.data):
                formats.read_sample(formats.data_file(cfg.data, i))
            keep = set(formats.read_data_config(cfg.data).extra["states"]["kept"])
            kept = {
                i: formats.data_file(cfg.data, i).stat().st_mtime_ns
                for i in formats.existing_data_indices(cfg.data)
                if i in keep
            }
            stopped.append(
                dict(
                    signal=sig,
                    proc=proc,
                    rows=rows,
                    children=children,
                    committed=committed_step(cfg.out)[0],
                    local_step=committed_step(cfg.out)[1],
                    at=when,
                    kept=kept,
                    left=sorted(x.name for x in cfg.data.iterdir()),
                )
            )
        resumed = subprocess.run(
            [sys.executable, "-m", module, *argv, "--resume"],
            cwd=REPO,
            env=pipeline_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return {"stops": stopped, "resumed": resumed, "max_bytes": watch.max}


def assert_recovered(cfg: TrainConfig, result: dict, total_steps: int) -> dict:
    """What must hold after `interrupt_then_resume`: the last run succeeded from the last checkpoint; every
    step's metrics row is there once and no step a checkpoint held was trained again after any stop; the
    state files never exceeded the budget; no partial file is left, only the kept files, the ones kept
    before the last stop reused (not produced again); `pipeline verify` passes the states dir. Returns the
    last run's summary."""
    from pipeline import verify

    resumed, last = result["resumed"], result["stops"][-1]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming at step {last['committed']}" in resumed.stderr
    assert result["max_bytes"] <= int(cfg.states_budget), (result["max_bytes"], cfg.states_budget)
    rows = train_rows(cfg.out)
    assert [r["step"] for r in rows] == list(range(total_steps))
    for stop in result["stops"]:
        again = [r["step"] for r in rows if r["time"] > stop["at"]]
        assert min(again) == stop["committed"], f"a step checkpointed before {stop['signal']!r} ran again"
    summary = json.loads((cfg.out / "summary.json").read_text())
    kept = formats.existing_data_indices(cfg.data)
    assert not list(cfg.data.glob(".*partial")) and len(kept) == summary["train"]["states"]["kept_samples"]
    assert {i: formats.data_file(cfg.data, i).stat().st_mtime_ns for i in last["kept"]} == last["kept"]
    assert not [c for c in verify.verify(verify.VerifyConfig(path=cfg.data)).checks if c.status == "fail"]
    return summary


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS)]


def torchrun(argv: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 -m pipeline ARGV`` on this host (a free rendezvous port); a job that
    outlives ``timeout`` (a hang) is killed whole, its ranks included, and fails the test."""
    job = subprocess.Popen(
        [*TORCHRUN, "-m", "pipeline", *argv],
        cwd=REPO,
        env=pipeline_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = job.communicate(timeout=timeout)
    except BaseException:
        kill_job(job)
        raise
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


def kill_job(job: subprocess.Popen) -> list[int]:
    """SIGKILL a torchrun job and every process under it (torchrun starts each rank in a session of its
    own, so a signal to its group misses them); return their pids."""
    import psutil

    try:
        pids = [p.pid for p in psutil.Process(job.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        pids = []
    for pid in [job.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.communicate(timeout=60)
    return pids


def gpu_pids() -> set[int]:
    """The pids of every compute process on every GPU, through NVML."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return {
            p.pid
            for i in range(pynvml.nvmlDeviceGetCount())
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))
        }
    finally:
        pynvml.nvmlShutdown()


class GpuPidWatch(Watch):
    """Every pid seen on a GPU while the block runs (NVML, every 50 ms)."""

    interval = 0.05

    def __init__(self):
        super().__init__()
        self.seen: set[int] = set()

    def sample(self) -> None:
        self.seen |= gpu_pids()
