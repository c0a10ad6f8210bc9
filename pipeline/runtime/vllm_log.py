"""What a failed vLLM run's log says, in one line: the root cause among vLLM's wrappers ("see root cause
above", EngineDeadError), for every place that starts an engine or a server and reports its death."""

from __future__ import annotations

import re

_ERROR_LINE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)$")
_WRAPPERS = ("root cause", "stack trace", "EngineDeadError", "Engine core initialization failed")


def root_cause(output: str) -> str:
    """The line of a failed vLLM run that says why: the first ``SomeError: message`` that is not one of
    vLLM's wrappers pointing back at it ("see root cause above", EngineDeadError), without the log
    prefix; else the last line naming an error; else the last line."""
    lines = output.strip().splitlines() or ["no output"]
    found = [m for ln in lines if (m := _ERROR_LINE.search(ln))]
    cause = next((m for m in found if not any(w in m.group(0) for w in _WRAPPERS)), None)
    if cause is not None:
        return cause.group(0)
    return found[-1].group(0) if found else lines[-1]
