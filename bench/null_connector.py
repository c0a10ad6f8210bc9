"""bench/capture_bench.py's "capture" row: our connector with nothing copied. The engine runs vLLM's
``extract_hidden_states`` (the drafter writes each step's states into its cache) and each finished request
is reported sent at once, so the row is the engine's cost of capturing with no copy, hand-over or write: what
lies between the plain prefill and an extraction. The engine imports it by module path, as ours."""

from __future__ import annotations

from pipeline.backends.vllm_connector import CopyDone, EagleStatesConnector

MODULE = __name__
NAME = "NullStatesConnector"


class NullStatesConnector(EagleStatesConnector):
    def _save_step(self, pendings) -> None:
        for pending in pendings:
            self._req_copy_events[pending.req_id] = CopyDone()
