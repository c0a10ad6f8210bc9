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

**Levers** (issue #52), each switched by an environment variable read at every step (``Levers.from_env``), so
that bench/capture_bench.py measures each against the last on one GPU; all off is the path above, and every
one keeps the states bit-identical to it (tests/vllm/test_capture_levers.py):

* ``EAGLE_VLLM_BULK_COPY=1``: the step's states leave the device in one copy (and its facts in two) into one
  host buffer, instead of one pinned allocation and copy per request and layer; each request's state per
  layer is a tensor on a slice of that buffer's storage (``storage_slice``), so it owns exactly its bytes
  (``torch.save`` writes those, not the buffer) and no writer copies it again;
* ``EAGLE_VLLM_PINNED_POOL=N`` (with the bulk copy): up to N pinned step buffers of the largest step's size,
  kept for the run and reused once every tensor on them is gone (their storage's use count) and their copy
  is done, instead of one from torch's caching host allocator per step;
* ``EAGLE_VLLM_CONNECTOR_THREAD=1``: the engine's thread only queues the step's device work (gather, facts,
  copies) and records its event; the requests' tensors are cut and handed over (or their files written) on
  a thread of the connector's own.

``STATS`` (this process's connectors) counts what the connector did: steps saved and their requests and
tokens, the engine thread's seconds in it, the bytes copied off the device, the copy stream's own seconds
(CUDA events), and on the scheduler side the engine steps' scheduled tokens (sizes and count).

The engine imports this module by name (``kv_connector_module_path``), so it imports vLLM at module level;
nothing but the vllm backend, the engine and the tests imports it.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Levers:
    """Which of the capture path's levers are on (module docstring); all off: the per-request copies."""

    bulk: bool = False  # EAGLE_VLLM_BULK_COPY
    pool: int = 0  # EAGLE_VLLM_PINNED_POOL: pinned step buffers kept (with bulk)
    thread: bool = False  # EAGLE_VLLM_CONNECTOR_THREAD

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Levers:
        def flag(name: str) -> bool:
            return environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")

        try:
            pool = int(environ.get("EAGLE_VLLM_PINNED_POOL", "0") or 0)
        except ValueError:
            pool = 0
        return cls(
            bulk=flag("EAGLE_VLLM_BULK_COPY"), pool=max(0, pool), thread=flag("EAGLE_VLLM_CONNECTOR_THREAD")
        )

    def describe(self) -> str:
        on = [
            n
            for n, v in (("bulk", self.bulk), (f"pool {self.pool}", self.pool), ("thread", self.thread))
            if v
        ]
        return ", ".join(on) or "none (per-request copies)"


def storage_slice(
    storage: torch.UntypedStorage, offset: int, dtype: torch.dtype, shape: tuple
) -> torch.Tensor:
    """A tensor of ``shape`` on bytes ``[offset, offset + its size)`` of ``storage``, as a storage of its own
    that keeps ``storage`` alive: ``torch.save`` writes exactly its bytes (a view would write the whole
    buffer) and ``x.untyped_storage().nbytes() == x.nbytes``."""
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    return torch.empty(0, dtype=dtype).set_(storage[offset : offset + nbytes], 0, shape)


def bulk_step_tensors(
    cache: torch.Tensor, saves: list[tuple[list[int], torch.Tensor]], buffer: Callable[[int], torch.Tensor]
) -> tuple[Callable[[], list[dict]], int]:
    """``step_tensors``' tensors, copied off the device in bulk: the same gather and the same
    ``token_scales`` per layer, then one copy of the step's ``[layers, N, H]`` states and two of its facts
    into one host buffer (``buffer(nbytes)``: a uint8 tensor of at least ``nbytes``, pinned on a GPU); the
    copies are queued on the current stream. Returns a function that cuts each request's tensors out of the
    buffer (storage slices, ``storage_slice``: call it once the copies are queued; the values are valid once
    they are done) and the bytes copied."""
    block_size = cache.shape[2]
    counts = [int(ids.shape[0]) for _, ids in saves]
    slots = torch.cat([slot_mapping(blocks, block_size)[:n] for (blocks, _), n in zip(saves, counts)])
    by_layer = gather_layers(cache, slots.to(cache.device, non_blocking=True))  # [L, N, H]
    scales = [token_scales(o) for o in by_layer.unsqueeze(1)]  # as step_tensors: one [1, N, H] per layer
    layers, total, hidden = by_layer.shape
    state_bytes = by_layer.numel() * by_layer.element_size()
    fact_bytes = layers * total * 4
    host = buffer(state_bytes + 2 * fact_bytes)
    host[:state_bytes].view(by_layer.dtype).view(layers, total, hidden).copy_(by_layer, non_blocking=True)
    rms = host[state_bytes : state_bytes + fact_bytes].view(torch.float32).view(layers, total)
    bad = host[state_bytes + fact_bytes : state_bytes + 2 * fact_bytes].view(torch.int32).view(layers, total)
    rms.copy_(torch.cat([r for r, _ in scales]), non_blocking=True)
    bad.copy_(torch.cat([b for _, b in scales]), non_blocking=True)
    storage, dtype, itemsize = host.untyped_storage(), by_layer.dtype, by_layer.element_size()
    ends = list(itertools.accumulate(counts))

    def cut() -> list[dict]:
        out = []
        for (_, ids), end, n in zip(saves, ends, counts, strict=True):
            start = end - n
            tensors = {"token_ids": ids.clone()}
            for j in range(layers):
                offset = (j * total + start) * hidden * itemsize
                tensors[f"hidden_states.{j}"] = storage_slice(storage, offset, dtype, (n, hidden))
                tensors[f"token_rms.{j}"] = rms[j, start:end]
                tensors[f"nonfinite.{j}"] = bad[j, start:end]
            out.append(tensors)
        return out

    return cut, state_bytes + 2 * fact_bytes


def use_count(buffer: torch.Tensor) -> int:
    """The references to ``buffer``'s storage (its own tensor's, the storage slices cut from it)."""
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata)


class PinnedPool:
    """Host step buffers kept for the run (``EAGLE_VLLM_PINNED_POOL``): ``take(nbytes, done)`` hands back a
    kept buffer that no tensor uses any more (its storage's use count is back to what the pool's own
    reference makes it) and whose last copy finished (``done.query()``), else a new one of ``size`` bytes
    while fewer than ``keep`` exist, else None (the caller allocates one for this step alone)."""

    def __init__(self, keep: int, size: int, pinned: bool):
        self.keep, self.size, self.pinned = keep, size, pinned
        self._buffers: list[list] = []  # [buffer, its free use count, the event of its last copy]
        self.allocated = self.misses = 0

    def take(self, nbytes: int) -> tuple[torch.Tensor, list] | None:
        for entry in self._buffers:
            buf, free, last = entry
            if buf.numel() >= nbytes and use_count(buf) == free and (last is None or last.query()):
                return buf, entry
        if len(self._buffers) < self.keep and nbytes <= self.size:
            buf = torch.empty(self.size, dtype=torch.uint8, pin_memory=self.pinned)
            entry = [buf, use_count(buf), None]
            self._buffers.append(entry)
            self.allocated += 1
            return buf, entry
        self.misses += 1
        return None


class Stats:
    """What this process's connectors did (thread-safe sums; module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.save_steps = self.requests = self.tokens = self.bytes = 0
        self.engine_thread_seconds = 0.0  # the engine's thread inside the connector's step saves
        self.post_seconds = 0.0  # the connector thread's seconds cutting and handing over (lever "thread")
        self.copy_events: list = []  # (start, end) CUDA timing events on the copy stream
        self.scheduled: list[int] = []  # tokens scheduled per engine step (scheduler side)
        self.levers = ""
        self.pool_allocated = self.pool_misses = 0

    def add(self, **figures) -> None:
        with self._lock:
            for k, v in figures.items():
                setattr(self, k, getattr(self, k) + v)

    def copy_seconds(self) -> float | None:
        """The copy stream's own seconds over the saved steps (waits for the last copy); None on the CPU."""
        with self._lock:
            events = list(self.copy_events)
        if not events:
            return None
        events[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in events) / 1000.0

    def figures(self) -> dict:
        steps = [n for n in self.scheduled if n > 0]
        return {
            "levers": self.levers,
            "save_steps": self.save_steps,
            "requests": self.requests,
            "tokens": self.tokens,
            "bytes_copied": self.bytes,
            "engine_thread_seconds": self.engine_thread_seconds,
            "connector_thread_seconds": self.post_seconds,
            "copy_stream_seconds": self.copy_seconds(),
            "engine_steps": len(steps),
            "step_tokens_mean": sum(steps) / len(steps) if steps else 0.0,
            "step_tokens_max": max(steps, default=0),
            "step_tokens_min": min(steps, default=0),
            "pool_allocated": self.pool_allocated,
            "pool_misses": self.pool_misses,
        }


STATS = Stats()


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
        self._pool: PinnedPool | None = None
        self._post: ThreadPoolExecutor | None = None
        STATS.reset()  # this engine's figures from its first step

    def build_connector_meta(self, scheduler_output):
        """vLLM's (scheduler side), counting the step's scheduled tokens for ``STATS``."""
        STATS.scheduled.append(int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0))
        return super().build_connector_meta(scheduler_output)

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
        t0 = time.perf_counter()
        levers = Levers.from_env()
        cache = self._kv_cache
        assert cache is not None
        saves = [(p.block_ids, p.token_ids) for p in pendings]
        on_gpu = cache.device.type == "cuda"
        taken: list = [None]  # the pool's entry the bulk copy went to, if any
        if on_gpu:
            stream = self._get_copy_stream()
            stream.wait_stream(torch.cuda.current_stream())  # the forward that filled the cache comes first
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record(stream)
            # the slots' upload from pageable memory is allowed to wait
            context: Any = contextlib.ExitStack()
            context.enter_context(torch.cuda.stream(stream))
            context.enter_context(gpu_sync_allowed())
        else:
            context = contextlib.nullcontext()
        with context:
            if levers.bulk:
                cut, nbytes = bulk_step_tensors(cache, saves, self._step_buffer(levers, on_gpu, taken))
            else:
                per_request = step_tensors(cache, saves, pinned_copy if on_gpu else torch.clone)
                nbytes = sum(t.nbytes for r in per_request for k, t in r.items() if k != "token_ids")

                def cut() -> list[dict]:
                    return per_request

        if on_gpu:
            done: Any = torch.cuda.Event()
            done.record(stream)
            timing[1].record(stream)
        else:
            done = CopyDone()  # the CPU build: no streams or events, the work is done when the calls return
        if taken[0] is not None:
            taken[0][2] = done  # the pool hands the buffer out again only once this copy is done
        locks = {}
        for pending in pendings:
            self._req_copy_events[pending.req_id] = done  # get_finished reports the request sent after it
            if not self._in_memory:  # the lock vLLM's reader waits on: taken here, on the engine's thread
                locks[pending.req_id] = self._lock_fd(pending)
        if levers.thread:
            if self._post is None:
                self._post = ThreadPoolExecutor(1, thread_name_prefix="eagle-connector")
            self._post.submit(self._hand_over, pendings, cut, done, locks, True)
        else:
            self._hand_over(pendings, cut, done, locks, False)
        STATS.add(
            save_steps=1,
            requests=len(pendings),
            tokens=sum(int(p.token_ids.shape[0]) for p in pendings),
            bytes=nbytes,
            engine_thread_seconds=time.perf_counter() - t0,
        )
        if on_gpu:
            with STATS._lock:
                STATS.copy_events.append(timing)
        STATS.levers = levers.describe()

    def _step_buffer(self, levers: Levers, on_gpu: bool, taken: list) -> Callable[[int], torch.Tensor]:
        """The bulk copy's host buffer as ``bulk_step_tensors`` asks for it: from the kept pool
        (``EAGLE_VLLM_PINNED_POOL``; its entry goes to ``taken[0]``), else a new one (on a GPU from torch's
        caching host allocator, pinned)."""

        def buffer(nbytes: int) -> torch.Tensor:
            if levers.pool:
                if self._pool is None or self._pool.keep != levers.pool:
                    self._pool = PinnedPool(levers.pool, self._largest_step_bytes(), pinned=on_gpu)
                got = self._pool.take(nbytes)
                STATS.pool_allocated, STATS.pool_misses = self._pool.allocated, self._pool.misses
                if got is not None:
                    taken[0] = got[1]
                    return got[0]
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)

        return buffer

    def _largest_step_bytes(self) -> int:
        """The host bytes of the largest step's bulk copy: every token of ``max_num_batched_tokens``."""
        cache = self._kv_cache
        tokens = self._vllm_config.scheduler_config.max_num_batched_tokens
        layers, hidden = cache.shape[1], cache.shape[3]
        return tokens * layers * (hidden * cache.element_size() + 8)

    def _lock_fd(self, pending: PendingSave) -> int | None:
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        return lock_fd

    def _hand_over(self, pendings, cut, done, locks: dict, timed: bool = True) -> None:
        """Each request's tensors to the in-memory hand-over, or to its file on the writer pool. On the
        connector's thread (``timed``) a failure is handed to each request's reader instead (an entry without
        states, which the backend refuses naming what it has), never lost in a future nobody reads."""
        t0 = time.perf_counter()
        try:
            per_request = cut()
        except Exception as exc:  # noqa: BLE001 - handed to the readers
            if not timed:
                raise
            per_request = [{"connector_error": repr(exc)} for _ in pendings]
        for pending, tensors in zip(pendings, per_request, strict=True):
            if self._in_memory:
                HANDOFF.put(pending.filename, done, tensors)
            else:
                self._write_async(pending, tensors, done, locks.get(pending.req_id))
        if timed:
            STATS.add(post_seconds=time.perf_counter() - t0)

    def _write_async(self, pending: PendingSave, tensors: dict, done: Any, lock_fd: int | None) -> None:
        """The request's file, written on the connector's writer pool under vLLM's lock protocol (``lock_fd``:
        its lock, taken on the engine's thread)."""
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
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
