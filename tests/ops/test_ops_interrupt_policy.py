"""The Ctrl-C policy of a run (ops.interrupts) with real SIGINTs sent to this process."""

from __future__ import annotations

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
