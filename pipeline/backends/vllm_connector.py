"""Our KV connector for vLLM's ``extract_hidden_states``: vLLM's ``ExampleHiddenStatesConnector`` with the
file laid out the way the extract loop uses it, made on the engine's own writer threads.

vLLM's connector writes one ``[T, layers, H]`` block per request. The extract loop then had to split it
into one ``[T, H]`` tensor per layer (a second copy of every byte) and compute each state's facts for the
closing check (``layer_profile.token_scales``: two passes over every byte), all on the extract process's
writer threads, which also write the data files: on the H200 that host-side work, not the GPU, bounded the
vllm loop (docs/benchmarks.md, "2026-12-03 evening": per sample 22 ms reading the block on top of the
facts and the write, the engine waiting for room).

This connector does the split and the facts where the block already is, on the engine process's writer
pool, after the device-to-host copy and before the file is written; the file holds ``token_ids`` and, per
layer j, ``hidden_states.{j}`` ``[T, H]``, ``token_rms.{j}`` ``[T]`` float32 and ``nonfinite.{j}`` ``[T]``
int32 (the same figures ``token_scales`` gives: pipeline/backends/vllm.py reads them as the hf backend's
device-made scales). Everything else (which requests, the block table, the lock protocol the reader waits
on, which rank writes) is vLLM's, unchanged: the class overrides the one static method that writes.

The engine process imports this module by name (``kv_connector_module_path``), so it imports vLLM at
module level; nothing but that engine and the tests imports it.
"""

from __future__ import annotations

import os

from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)

from pipeline.layer_profile import token_scales

MODULE = __name__
NAME = "EagleStatesConnector"


def layer_tensors(block, token_ids) -> dict:
    """The file's tensors for a ``[T, layers, H]`` block (pure; what the reader expects)."""
    out = {"token_ids": token_ids}
    for j in range(block.shape[1]):
        h = block[:, j].contiguous()
        rms, bad = token_scales(h)
        out[f"hidden_states.{j}"] = h
        out[f"token_rms.{j}"] = rms.contiguous()
        out[f"nonfinite.{j}"] = bad.contiguous()
    return out


class EagleStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's hidden-states connector writing per-layer states and their facts (module docstring)."""

    @staticmethod
    def _write_tensors(tensors, event, filename: str, lock_fd: int | None) -> None:
        try:
            event.synchronize()
            save_file(layer_tensors(tensors["hidden_states"], tensors["token_ids"]), filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: the reader may open the file
