"""Our KV connector for vLLM's ``extract_hidden_states``: how each finished request's layer states leave the
engine, laid out the way the extract loop uses them, with their facts computed on the device.

vLLM's ``ExampleHiddenStatesConnector`` copies one ``[T, layers, H]`` block per request to the host and
writes it to a safetensors file, which the extract process then read, split per layer (a second copy of
every byte) and scanned twice for each state's facts (``layer_profile.token_scales``), before writing its
own data file: on the H200 that host-side work, not the GPU, bounded the vllm loop (docs/benchmarks.md,
"2026-12-03 evening": 20-23 ms per sample reading the block, on top of the facts and the write).

This connector keeps vLLM's bookkeeping (which requests, their block tables, when a request counts as sent,
which rank writes) and replaces how the states move: all the requests waiting to be saved in a step are
saved at once when the step's metadata is bound, before its forward is launched (``bind_connector_metadata``;
vLLM saves each request on its own after the forward, from ``get_finished``). On the device, on the
connector's copy stream, one gather takes every request's states out of the cache, laid out per layer; each
layer's ``token_scales`` are computed once; each request's per-layer states and the facts are copied into
pinned host memory. Sampled on the H200, the per-request way cost the engine's thread ~4 s of a 9 s loop
(~50 small calls per request; docs/benchmarks.md). Where they go from there depends on where the engine's
worker runs:

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
import itertools
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
)
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from pipeline.backends.base import pinned_copy, split_rows
from pipeline.model.layer_profile import token_scales

MODULE = __name__
NAME = "EagleStatesConnector"


def slot_mapping(block_ids: list[int], block_size: int) -> torch.Tensor:
    """The KV-cache slots of a request's blocks, in token order (pure)."""
    ids = torch.tensor(block_ids, dtype=torch.long).reshape(-1, 1)
    return (ids * block_size + torch.arange(block_size, dtype=torch.long).reshape(1, -1)).flatten()


def gather_layers(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The states at ``slots`` of the hidden-states cache (``[blocks, layers, block_size, H]``, vLLM's
    layout for ``extract_hidden_states``), one gather laid out per layer: ``[layers, len(slots), H]``."""
    block_size = cache.shape[2]
    return cache.transpose(0, 1)[:, slots // block_size, slots % block_size]


def step_tensors(cache: torch.Tensor, saves: list[tuple[list[int], torch.Tensor]], copy) -> list[dict]:
    """The tensors of each request saved in one step (``saves``: its block ids and token ids), as the reader
    expects them: ``token_ids`` and per layer j ``hidden_states.{j}`` (``[T, H]``, a ``copy`` of its own),
    ``token_rms.{j}`` and ``nonfinite.{j}`` (``layer_profile.token_scales``, views of one ``copy`` per layer).

    The whole step at once: one gather of every request's slots, one ``token_scales`` per layer, one copy
    per request and layer. Per request, as vLLM's connector does it, the same work was ~50 small calls per
    request on the engine's thread, which on the H200 held the GPU's next step back (docs/benchmarks.md)."""
    block_size = cache.shape[2]
    counts = [int(ids.shape[0]) for _, ids in saves]
    slots = torch.cat([slot_mapping(blocks, block_size)[:n] for (blocks, _), n in zip(saves, counts)])
    by_layer = gather_layers(cache, slots.to(cache.device, non_blocking=True)).unsqueeze(1)  # [L, 1, N, H]
    outs = list(by_layer)
    ends = list(itertools.accumulate(counts))
    rows = [(0, slice(end - n, end)) for end, n in zip(ends, counts)]  # split_rows' packed layout: row 0
    states, scales = split_rows(outs, rows, [token_scales(o) for o in outs], copy)
    out = []
    for (_, ids), hs, facts in zip(saves, states, scales):
        tensors = {"token_ids": ids.clone()}
        for j, (h, (rms, bad)) in enumerate(zip(hs, facts)):
            tensors[f"hidden_states.{j}"] = h
            tensors[f"token_rms.{j}"] = rms
            tensors[f"nonfinite.{j}"] = bad
        out.append(tensors)
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

    def bind_connector_metadata(self, connector_metadata) -> None:
        """The step's metadata, bound by the model runner before it launches the step's forward: the
        requests that finished earlier and wait to be saved are saved here, all at once (``_save_step``), so
        that their copies are queued ahead of this forward and run beside it."""
        super().bind_connector_metadata(connector_metadata)
        saves = getattr(connector_metadata, "pending_saves", None)
        if saves and self._is_tp_rank_zero:
            self._save_step([p for p in saves if p.req_id not in self._req_copy_events])

    def _submit_async_write(self, pending: PendingSave) -> None:
        """vLLM's per-request save, which its ``get_finished`` calls for each of the step's pending saves:
        they were saved with their step when the metadata was bound; one that was not is saved alone."""
        if self._is_tp_rank_zero and pending.req_id not in self._req_copy_events:
            self._save_step([pending])

    def _save_step(self, pendings: list[PendingSave]) -> None:
        if not pendings:
            return
        cache = self._kv_cache
        assert cache is not None
        saves = [(p.block_ids, p.token_ids) for p in pendings]
        if cache.device.type != "cuda":
            # the CPU build: no streams or events, the work is done when the calls return
            per_request = step_tensors(cache, saves, torch.clone)
            done: Any = CopyDone()
        else:
            stream = self._get_copy_stream()
            stream.wait_stream(torch.cuda.current_stream())  # the forward that filled the cache comes first
            with torch.cuda.stream(stream), gpu_sync_allowed():  # the slots' upload from pageable memory
                per_request = step_tensors(cache, saves, pinned_copy)
            done = torch.cuda.Event()
            done.record(stream)
        for pending, tensors in zip(pendings, per_request, strict=True):
            self._req_copy_events[pending.req_id] = done  # get_finished reports the request sent after it
            if self._in_memory:
                HANDOFF.put(pending.filename, done, tensors)
            else:
                self._write_async(pending, tensors, done)

    def _write_async(self, pending: PendingSave, tensors: dict, done: Any) -> None:
        """The request's file, written on the connector's writer pool under vLLM's lock protocol."""
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
