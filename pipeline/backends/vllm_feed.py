"""The thread that drives a vLLM engine for extraction: the next batches' requests are added while the
engine still runs the last ones, so it never drains between batches.

Owns every call into the engine after its construction (``LLM.enqueue`` and ``LLMEngine.step``), from one
thread: vLLM's offline engine is not meant to be driven from several. ``submit`` hands a batch of prompts
over and returns one future per prompt at once; each future resolves with its request's final
``RequestOutput`` (vLLM reports a request finished once its states are copied off the device; the
connector's file write may still run, under the file's lock). The caller reads results whenever it likes,
on any thread: the engine keeps stepping the requests it has.

Why not ``LLM.generate`` per batch (the first GPU run, 2026-12-03): it returns only when every request of
the batch is done, so the GPU idled while the batch's files were read and written, and each batch began
with an empty engine. Here the engine always has the next batch queued behind the running one.

A failure inside the engine (the engine process died, a request was refused) fails every future not yet
resolved and every later ``submit``, with the engine's own error; nothing waits forever on a dead engine.
It deliberately owns no files, no checks and no back-pressure: pipeline/backends/vllm.py reads and checks
each result, and the extract loop's writer bounds how far ahead the batches run.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from pipeline.errors import StageError

_STOP = object()
# the pause of an engine step that returned nothing while only connector copies were left (in-process core)
IDLE_STEP_S = 0.0005


def connector_work(engine: Any) -> bool:
    """Whether an engine core running in this process still holds requests for the connector: finished
    requests whose states it has not yet copied off the device (it does that on the step after they finish).
    An engine core in its own process keeps stepping for them by itself: False."""
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    return core is not None and core.scheduler.has_requests()


def external_id(request_id: str) -> str:
    """The id a request's output carries for the id ``LLM.enqueue`` returned: vLLM 0.32 appends
    ``-<8 random characters>`` to the caller's id inside the engine (``InputProcessor.assign_request_id``),
    unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set; the LLM's own ids are plain integers."""
    head, sep, tail = request_id.rpartition("-")
    return head if sep and head.isdigit() and len(tail) == 8 else request_id


class EngineFeed:
    """One thread stepping ``llm``'s engine; ``submit`` queues prompts, ``close`` stops the thread."""

    def __init__(self, llm: Any, params: Any):
        self._llm = llm
        self._params = params
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._waiting: dict[str, Future] = {}  # request id -> its future (engine thread only)
        self.steps = 0  # engine steps taken (figures for the run's stats)
        self._thread = threading.Thread(target=self._run, name="vllm-engine-feed", daemon=True)
        self._thread.start()

    def submit(self, prompts: Sequence[Any]) -> list[Future]:
        """One future per prompt, in order; the requests join the engine's queue behind those already in."""
        futures: list[Future] = [Future() for _ in prompts]
        with self._lock:
            if self._error is not None:
                raise self._error
            self._inbox.put((list(prompts), futures))
        return futures

    def _run(self) -> None:
        engine = self._llm.llm_engine
        try:
            while True:
                # wait for work only when the engine has none; else take what has arrived and step
                block = not self._waiting and not connector_work(engine)
                while True:
                    try:
                        item = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    if item is _STOP:
                        return
                    prompts, futures = item
                    ids = self._llm.enqueue(prompts, self._params, use_tqdm=False)
                    if len(ids) != len(futures):
                        raise RuntimeError(f"vLLM queued {len(ids)} requests for {len(futures)} prompts")
                    for rid, future in zip(ids, futures, strict=True):
                        self._waiting[external_id(rid)] = future
                    block = False
                outputs = engine.step()
                if not outputs and not self._waiting:
                    time.sleep(IDLE_STEP_S)  # only the connector's copies are left: let them finish
                for output in outputs:
                    if output.finished:
                        future = self._waiting.pop(output.request_id, None)
                        if future is None:
                            raise RuntimeError(
                                f"vLLM finished request {output.request_id}, which was not ours"
                            )
                        future.set_result(output)
                self.steps += 1
                if self._waiting and not engine.has_unfinished_requests():
                    lost = sorted(self._waiting)[:3]
                    raise RuntimeError(f"vLLM has no unfinished request, but requests {lost} never finished")
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter and every later submit
            self._fail(exc)

    def check_alive(self) -> None:
        """Raise the engine's error once it has stopped (for callers that wait on the engine's side effects
        rather than on a future)."""
        with self._lock:
            if self._error is not None:
                raise StageError(f"the vLLM engine stopped: {type(self._error).__name__}: {self._error}")
            if not self._thread.is_alive():
                raise StageError("the vLLM engine was closed")

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self._error = exc
            pending = list(self._waiting.values())
            self._waiting.clear()
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    pending.extend(item[1])
        for future in pending:
            if not future.done():
                future.set_exception(exc)

    def close(self) -> None:
        """Stop stepping (requests still in the engine are left to its shutdown) and join the thread."""
        with self._lock:
            self._inbox.put(_STOP)
        self._thread.join()
