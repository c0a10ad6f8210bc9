"""Our KV connector for vLLM's ``extract_hidden_states``: how each finished request's layer states leave the
engine, laid out the way the extract loop uses them, with their facts computed on the device.

vLLM's ``ExampleHiddenStatesConnector`` copies one ``[T, layers, H]`` block per request to the host and
writes it to a safetensors file, which the extract process then read, split per layer (a second copy of
every byte) and scanned twice for each state's facts (``layer_profile.token_scales``), before writing its
own data file: on the H200 that host-side work, not the GPU, bounded the vllm loop (docs/benchmarks.md,
"2026-12-03 evening": 20-23 ms per sample reading the block, on top of the facts and the write).

This connector keeps vLLM's bookkeeping (which requests, their block tables, when a request counts as sent,
which rank writes) and replaces the one method that moves the states (``_submit_async_write``): on the
device, on the connector's copy stream, it gathers the request's block, splits it per layer and computes each
layer's ``token_scales``, then copies the per-layer states and facts into pinned host memory. Where they go
from there depends on where the engine's worker runs:

* **in the extract process** (tensor parallel 1 with the engine core in-process, vLLM's
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the backend asks for it with ``HANDOFF.enable()`` before it builds
  the engine): the host tensors and the copy's CUDA event are handed over in memory (``Handoff``), keyed by
  the request's ``hidden_states_path``; no file, no lock. The reader waits for the event, so the engine
  never waits for the reader. Per sample the extract process then does what it does for the hf backend:
  one write of its data file.
* **in another process** (a worker of a tensor-parallel engine): the same tensors are written, on the
  connector's writer pool, to the request's file under vLLM's lock protocol (the reader takes a shared lock
  on ``<file>.lock``): ``token_ids`` and, per layer j, ``hidden_states.{j}`` ``[T, H]``, ``token_rms.{j}``
  ``[T]`` float32 and ``nonfinite.{j}`` ``[T]`` int32.

The engine imports this module by name (``kv_connector_module_path``), so it imports vLLM at module level;
nothing but the vllm backend, the engine and the tests imports it.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from pipeline.model.layer_profile import token_scales

MODULE = __name__
NAME = "EagleStatesConnector"


def layer_tensors(block: torch.Tensor, token_ids: torch.Tensor) -> dict:
    """The tensors of one request for a ``[T, layers, H]`` block, on the block's device (pure; what the
    reader expects): per layer its contiguous ``[T, H]`` state and the state's ``token_scales``."""
    out = {"token_ids": token_ids}
    for j in range(block.shape[1]):
        h = block[:, j].contiguous()
        rms, bad = token_scales(h)
        out[f"hidden_states.{j}"] = h
        out[f"token_rms.{j}"] = rms
        out[f"nonfinite.{j}"] = bad
    return out


def slot_mapping(block_ids: list[int], block_size: int) -> torch.Tensor:
    """The KV-cache slots of a request's blocks, in token order (pure)."""
    ids = torch.tensor(block_ids, dtype=torch.long).reshape(-1, 1)
    return (ids * block_size + torch.arange(block_size, dtype=torch.long).reshape(1, -1)).flatten()


def to_host(tensors: dict) -> dict:
    """Each device tensor copied into pinned host memory without waiting (the caller records the event)."""
    out = {}
    for name, t in tensors.items():
        if t.device.type == "cpu":
            out[name] = t
        else:
            out[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out[name].copy_(t, non_blocking=True)
    return out


class CopyDone:
    """The "event" of a copy that finished when its call returned (the CPU build): what vLLM's
    ``get_finished`` polls (``query``) and the readers wait on (``synchronize``)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Handoff:
    """Requests' host tensors handed from the connector to the extract loop inside one process.

    ``enable()`` (by the backend, before it builds the engine) names this process as the one whose
    connector hands over in memory: a connector running in any other process (a worker process, an engine
    core process that inherited the module by fork) writes files instead. ``put`` never blocks the engine;
    ``take`` waits for the entry and then for its copy; ``drop`` discards an entry nobody will read, whether
    it arrived yet or not. Thread-safe."""

    def __init__(self):
        self._cond = threading.Condition()
        self._entries: dict[str, tuple[Any, dict]] = {}
        self._dropped: set[str] = set()
        self._owner: int | None = None
        self.connected = False  # a connector of this process took the in-memory hand-over

    def enable(self) -> None:
        with self._cond:
            self._owner, self.connected = os.getpid(), False
            self._entries.clear()
            self._dropped.clear()

    def disable(self) -> None:
        with self._cond:
            self._owner, self.connected = None, False
            self._entries.clear()
            self._dropped.clear()
            self._cond.notify_all()

    def claim(self) -> bool:
        """Called by a connector at engine start: True (and ``connected``) when it runs in the process that
        enabled the hand-over."""
        with self._cond:
            self.connected = self._owner == os.getpid()
            return self.connected

    def put(self, key: str, event: Any, tensors: dict) -> None:
        with self._cond:
            if key in self._dropped:
                self._dropped.discard(key)
                return
            self._entries[key] = (event, tensors)
            self._cond.notify_all()

    def take(self, key: str, alive: Callable[[], None], poll: float = 0.5) -> dict:
        """The request's tensors once copied; ``alive()`` is called while waiting and raises to give up
        (the engine stopped)."""
        with self._cond:
            while key not in self._entries:
                alive()
                self._cond.wait(poll)
            event, tensors = self._entries.pop(key)
        event.synchronize()
        return tensors

    def drop(self, key: str) -> None:
        with self._cond:
            if self._entries.pop(key, None) is None:
                self._dropped.add(key)

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)


HANDOFF = Handoff()


class EagleStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's hidden-states connector moving per-layer states and their facts (module docstring)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        super().register_kv_caches(kv_caches)
        self._in_memory = self._is_tp_rank_zero and HANDOFF.claim()

    def wait_for_save(self) -> None:
        if not getattr(self, "_in_memory", False):
            super().wait_for_save()  # lock files exist before the client learns their paths

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        cache = self._kv_cache
        assert cache is not None
        slots = slot_mapping(pending.block_ids, self._block_size)
        count = pending.token_ids.shape[0]
        if cache.device.type != "cuda":
            # the CPU build: no streams or events, the work is done when the calls return
            tensors = layer_tensors(extract_from_kv_cache(cache, slots, count), pending.token_ids.clone())
            done: Any = CopyDone()
        else:
            stream = self._get_copy_stream()
            stream.wait_stream(torch.cuda.current_stream())  # the forward that filled the cache comes first
            with torch.cuda.stream(stream):
                with gpu_sync_allowed():
                    slots = slots.to(device=cache.device, non_blocking=True)
                block = extract_from_kv_cache(cache, slots, count)
                tensors = to_host(layer_tensors(block, pending.token_ids.clone()))
            done = torch.cuda.Event()
            done.record(stream)
        assert pending.req_id not in self._req_copy_events, "two saves of one request"
        self._req_copy_events[pending.req_id] = done  # get_finished reports the request sent after it
        if self._in_memory:
            HANDOFF.put(pending.filename, done, tensors)
            return
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(_write_file, tensors, done, pending.filename, lock_fd)
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, rid=pending.req_id: self._on_write_done(rid, f))


def _write_file(tensors: dict, done: Any, filename: str, lock_fd: int | None) -> None:
    """The writer pool's job: wait for the copy, write the file, release the lock the reader waits on."""
    try:
        done.synchronize()
        save_file(tensors, filename)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
