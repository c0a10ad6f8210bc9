"""The Ctrl-C policy of a run (ops.interrupts) with real SIGINTs sent to this process."""

from __future__ import annotations

import contextlib
import io
import os
import signal

import pytest
from rich.console import Console

from ops.interrupts import Interrupts
from ops.runstate import RunState


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_first_ctrl_c_waits_for_the_step_boundary_second_acts_at_once(tmp_path):
    """A first SIGINT inside a step only marks it pending (the step goes on) and the next step boundary
    raises; inside an interruptible block, and for a second SIGINT, KeyboardInterrupt comes at once;
    the state file records the step the interrupt landed in."""
    out = io.StringIO()
    with Interrupts(Console(file=out)) as intr:
        state = RunState(tmp_path / "state.json", intr, run_id="r")
        state.step("stop-server")
        _sigint()
        finished_the_step = True  # still running: the interrupt is deferred
        assert intr.pending and "finishing the current step" in out.getvalue()
        with pytest.raises(KeyboardInterrupt):
            state.step("clean")
        assert finished_the_step and state.data["step"] == "stop-server"
        with pytest.raises(KeyboardInterrupt), intr.interruptible():
            _sigint()
            raise AssertionError("not interrupted at once")
        _sigint()
        with pytest.raises(KeyboardInterrupt):
            _sigint()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler given back


def _host_thread(tmp_path, body):
    """A per-host thread of a multi-host run: its own Interrupts block and run state; `body` gets both and
    a list of what happened; the thread reports how it ended."""
    import threading

    seen: list[str] = []
    entered = threading.Event()

    def work() -> None:
        try:
            with Interrupts(Console(file=io.StringIO())) as intr:
                state = RunState(tmp_path / "state.json", intr, run_id="r")
                body(intr, state, seen, entered)
            seen.append("returned")
        except KeyboardInterrupt:
            seen.append("interrupted")

    t = threading.Thread(target=work, daemon=True)
    t.start()
    assert entered.wait(10)
    return t, seen


def test_a_host_threads_ctrl_c_waits_for_its_step_boundary(tmp_path):
    """interrupt_thread (how the multi-host run hands Ctrl-C to each host's thread): inside a step the
    step runs to its end and the next step boundary raises; no KeyboardInterrupt lands mid-step."""
    import threading
    import time

    from ops.interrupts import interrupt_thread

    go = threading.Event()

    def body(intr, state, seen, entered):
        state.step("stop-server")
        entered.set()
        go.wait(10)
        for _ in range(20):  # the rest of the step: Python code an asynchronous exception would hit
            time.sleep(0.01)
        seen.append("step finished")
        state.step("clean")
        seen.append("next step ran")

    t, seen = _host_thread(tmp_path, body)
    interrupt_thread(t)
    go.set()
    t.join(10)
    assert seen == ["step finished", "interrupted"]


def test_a_host_threads_ctrl_c_acts_at_once_when_interruptible_or_pressed_again(tmp_path):
    """Inside an interruptible block (following the logs) the first Ctrl-C raises at once; inside a step,
    a second one (now=True) does."""
    import time

    from ops.interrupts import interrupt_thread

    for now, interruptible in ((False, True), (True, False)):

        def body(intr, state, seen, entered, interruptible=interruptible):
            state.step("follow")
            with intr.interruptible() if interruptible else contextlib.nullcontext():
                entered.set()
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    time.sleep(0.01)
                seen.append("ran to its end")

        t, seen = _host_thread(tmp_path, body)
        t0 = time.monotonic()
        interrupt_thread(t, now=now)
        t.join(10)
        assert seen == ["interrupted"] and time.monotonic() - t0 < 5, (now, interruptible, seen)
        assert not t.is_alive()
