"""The interface every hidden-state backend implements, so that the extract loop is backend-agnostic.

A backend loads the target model once and, for a batch of token-id sequences, returns for each sequence
the OUTPUT of each requested decoder layer (pre-final-norm residual stream), shape [T, H], on the CPU,
in the model dtype, each tensor owning its storage (never a view into a padded batch). The extract loop
(pipeline/extract.py) owns batching, ordering, files, resume and progress; a backend owns only the model.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.modeldir import ModelDir


@dataclass(frozen=True)
class BackendOptions:
    """What a backend needs to load the model."""

    model: ModelDir
    layer_ids: tuple[int, ...]
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU) | "bfloat16" | "float16" | "float32"
    seq_length: int = 2048
    tensor_parallel_size: int | None = None  # vllm only; default: all visible devices
    max_batch_tokens: int = 16384
    trust_remote_code: bool = False
    cache_dir: Path | None = None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    except KeyError:
        from pipeline.errors import StageError

        raise StageError(f"unknown --dtype {dtype!r}: choose auto, bfloat16, float16 or float32") from None


class DeviceClock:
    """Seconds the device spent on the work between ``start()`` and ``stop()``, summed over calls.

    On a GPU: CUDA events on the current stream, so the figure is the stream's own time (kernels and the
    device-to-host copy), not the host's; read it only after the stream has synchronised (``settle()``).
    On the CPU the host is the device: wall time. The extract loop turns the sum into the device's idle
    fraction (time the GPU waited for the host: batching, checks, writer back-pressure)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._marks: tuple | None = None
        self._t0 = 0.0

    def start(self) -> None:
        if self.cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._marks = (begin, None)
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._marks = (self._marks[0], end)
        else:
            self.seconds += time.perf_counter() - self._t0

    def settle(self) -> None:
        """Add the last start..stop interval (CUDA: the stream must have passed the stop event)."""
        if self.cuda and self._marks is not None:
            begin, end = self._marks
            self.seconds += begin.elapsed_time(end) / 1000.0
            self._marks = None


class Backend(ABC):
    """A loaded target model that captures hidden states."""

    name: str
    #: device time spent inside capture(), when the backend measures it (the hf backend does)
    clock: DeviceClock | None = None

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @abstractmethod
    def capture(self, batch: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
        """For each sequence, one [T, H] tensor per layer id (in layer-id order), on the CPU."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the model and devices."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
