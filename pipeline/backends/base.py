"""The interface every hidden-state backend implements, so that the extract loop is backend-agnostic.

A backend loads the target model once and, for a batch of token-id sequences, returns for each sequence
the OUTPUT of each requested decoder layer (pre-final-norm residual stream), shape [T, H], on the CPU,
in the model dtype, each tensor owning its storage (never a view into a padded batch). The extract loop
(pipeline/extract.py) owns batching, ordering, files, resume and progress; a backend owns only the model.
"""

from __future__ import annotations

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


class Backend(ABC):
    """A loaded target model that captures hidden states."""

    name: str

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
