"""Hidden-state capture backends. ``get_backend`` imports only the one asked for."""

from __future__ import annotations

from contract.backends import BACKENDS
from pipeline.backends.base import Backend, BackendOptions
from pipeline.errors import StageError


def get_backend(name: str, options: BackendOptions) -> Backend:
    if name == "hf":
        from pipeline.backends.hf import HFBackend

        return HFBackend(options)
    if name == "vllm":
        from pipeline.backends.vllm import VllmBackend

        return VllmBackend(options)
    raise StageError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "BackendOptions", "get_backend"]
