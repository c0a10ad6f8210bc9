"""The interface every hidden-state backend implements, so that the extract loop is backend-agnostic.

A backend loads the target model once and, for a batch of token-id sequences, returns for each sequence
the OUTPUT of each requested decoder layer (pre-final-norm residual stream), shape [T, H], on the CPU,
in the model dtype, each tensor owning its storage (never a view into a padded batch). The extract loop
(pipeline/extract/) owns batching, ordering, files, resume and progress; a backend owns only the model.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from pipeline.model.modeldir import ModelDir

# torch only in annotations here: the functions that use it import it, so that a command that only parses its
# arguments (--help, check-args) never loads it (tests/pipeline/test_cli_imports.py)
if TYPE_CHECKING:
    import torch


def visible_device_count() -> int:
    """GPUs this process may use (CUDA_VISIBLE_DEVICES honoured); 0 without any (a CPU build of torch too).
    torch counts through NVML before CUDA is initialized, so this process creates no CUDA context (nor
    poisons a later fork) before vLLM spawns its workers: what vLLM's own stateless count does, without
    importing vLLM, whose import cost every hf run ~1 s before (it pulls in torch's inductor)."""
    import torch

    return torch.cuda.device_count()


@dataclass(frozen=True)
class BackendOptions:
    """What a backend needs to load the model."""

    model: ModelDir
    layer_ids: tuple[int, ...]
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU) | "bfloat16" | "float16" | "float32"
    seq_length: int = 2048
    tensor_parallel_size: int | None = None  # vllm only; default: all visible devices
    max_batch_tokens: int = 32768
    trust_remote_code: bool = False
    packed: bool | None = None  # hf: samples end to end in one row, varlen attention; None = on a GPU only
    compile: bool | None = None  # hf: torch.compile each decoder layer; None = on a GPU, for long runs
    fused_norms: bool | None = None  # hf: RMSNorms through torch's fused kernel; None = on a GPU, when eager
    fused_experts: bool | None = None  # hf: an MoE's experts through vLLM's fused kernel; None = on a GPU
    # hf, fused experts: the tile sets timed beside vLLM's default (None: fused_experts.TILES; (): vLLM's own)
    expert_tiles: tuple[dict, ...] | None = None
    planned_tokens: int | None = None  # tokens the run will capture (None: unknown), for the compile decision
    enforce_eager: bool = False  # vllm only: no CUDA graphs / torch.compile (faster start, slower loop)
    expert_parallel: bool = False  # vllm only: an MoE's whole experts spread over the GPUs, not sliced
    scratch_dir: Path | None = None  # vllm only: where the engine's per-request files wait to be read
    memory_share: float | None = None  # vllm only: gpu_memory_utilization; None: vLLM's default


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    except KeyError:
        from pipeline.errors import StageError

        raise StageError(f"unknown --dtype {dtype!r}: choose auto, bfloat16, float16 or float32") from None


@contextmanager
def timed_part(figures: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall seconds of the ``with`` block to ``figures[name]``: a backend's start-up, part by part. A
    part that never ran is absent from ``figures``, never 0."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        figures[name] = figures.get(name, 0.0) + time.perf_counter() - t0


class DeviceClock:
    """Seconds the device spent on the work between each ``start()`` and ``stop()``, summed.

    On a GPU: a pair of CUDA events per interval on the current stream, so the figure is the stream's own
    time (the hf backend's forward kernels; its device-to-host copies run on a second stream and overlap
    the next forward, so they are not counted), not the host's. Intervals that the host queues while the
    stream is still busy begin when the stream reaches them, so they never overlap. Recording never waits
    for the device; ``settle()`` does (call it once the work is done). On the CPU the host is the device:
    wall time. The extract loop turns the sum into the device's idle fraction (time the GPU waited for
    the host: batching, checks, writer back-pressure)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._seconds = 0.0
        self._pending: list = []
        self._t0 = 0.0

    def start(self) -> None:
        import torch

        if self.cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._pending.append([begin, None])
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        import torch

        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending[-1][1] = end
        else:
            self._seconds += time.perf_counter() - self._t0

    def settle(self) -> None:
        """Add every finished interval (CUDA: waits for the last one's stop event)."""
        done = [pair for pair in self._pending if pair[1] is not None]
        if done:
            done[-1][1].synchronize()
        for begin, end in done:
            self._seconds += begin.elapsed_time(end) / 1000.0
        self._pending = [pair for pair in self._pending if pair[1] is None]

    @property
    def seconds(self) -> float:
        self.settle()
        return self._seconds


def _ready() -> None:
    """States computed synchronously need no waiting."""


@dataclass
class Captured:
    """One batch's states, possibly still being copied to the host: call ``ready()`` (thread-safe, idempotent)
    before reading their values. Shapes and dtypes are final at once."""

    states: list[list[torch.Tensor]]
    ready: Callable[[], None] = field(default=_ready)
    #: per sample, per state, its ``layer_profile.token_scales`` (host tensors, valid after ``ready()``)
    #: where the backend computed them on the device; None: the writer computes them from the states
    scales: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None
    #: per sample, a ``ready`` of its own (the vllm backend fills each sample's states from its own file, on
    #: the writer thread that writes it); None: every sample waits on the batch's ``ready``
    sample_ready: list[Callable[[], None]] | None = None
    #: frees what the backend holds for sample k when nobody will read it (a resumed batch's samples already
    #: on disk); a no-op for backends that hold nothing per sample
    discard: Callable[[int], None] = field(default=lambda k: None)

    def ready_of(self, k: int) -> Callable[[], None]:
        """What sample k waits on before its states are read."""
        return self.sample_ready[k] if self.sample_ready is not None else self.ready

    def wait_all(self) -> list[list[torch.Tensor]]:
        """Every sample's states, once all are ready (the synchronous ``capture``)."""
        for k in range(len(self.states)):
            self.ready_of(k)()
        return self.states


class Backend(ABC):
    """A loaded target model that captures hidden states."""

    name: str
    #: device time spent inside capture(), when the backend measures it (the hf backend does)
    clock: DeviceClock | None = None
    #: the load's seconds by part (``*_seconds``, the hf backend's: see ``HFBackend``), where the backend
    #: measures them; the extract stage adds them to its start-up figures
    startup: Mapping[str, float] = MappingProxyType({})

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @abstractmethod
    def capture(self, batch: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
        """For each sequence, one [T, H] tensor per layer id (in layer-id order), on the CPU."""

    def capture_async(self, batch: Sequence[Sequence[int]]) -> Captured:
        """Like ``capture``, but may return before the host copies finish, so the caller can queue the next
        batch on the device while this one is written. Backends that cannot overlap return ready states."""
        return Captured(self.capture(batch))

    def figures(self) -> dict:
        """Where the backend's side of the loop went (the extract loop's stats carry it as ``backend``); {}
        where the backend measures nothing of its own."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the model and devices."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def split_rows(
    outs: list[torch.Tensor],
    rows: list[tuple[int, slice]],
    scales: list[tuple[torch.Tensor, torch.Tensor]],
    copy,
) -> tuple[list[list[torch.Tensor]], list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Each sample's states (one ``copy`` per sample and layer: padding never leaves the device) and its
    per-token scales (each layer's ``copy``'d whole, once: T floats against T x H states, then viewed per
    sample), from a batch's captured outputs and where each sample's rows are in them (``inputs``)."""
    states = [[copy(o[r]) for o in outs] for r in rows]
    whole = [(copy(rms), copy(bad)) for rms, bad in scales]
    return states, [[(rms[r], bad[r]) for rms, bad in whole] for r in rows]


def pinned_copy(src: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of ``src``, queued on the current stream (from torch's caching host allocator, so
    reuse costs nothing)."""
    import torch

    h = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    h.copy_(src, non_blocking=True)
    return h
