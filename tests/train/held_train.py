"""``python -m tests.train.held_train STAGE ...``: ``python -m pipeline``, and with ``HOLD`` in the
environment (tests/train/states_helpers.py sets it for one run) the process stops itself (SIGSTOP) right after
the metrics row that makes that many training rows, so that a test's signal lands at that step. Polling
metrics.jsonl alone let a SIGKILL meant for epoch 1 land after the last step on a loaded 2-core machine: the
polling test process was descheduled past the rest of the run."""

from __future__ import annotations

import json
import os
import signal

HOLD = "EAGLE_TEST_HOLD_AT_ROWS"


def hold_at(rows: int) -> None:
    """Stop this process (SIGSTOP) once, right after the metrics row that makes ``rows`` training rows
    (counting the rows an earlier run of the same output left). Once: a process continued after a caught
    signal (SIGINT) may write another row on its way out and must not stop again."""
    from pipeline.train import trainer

    emit = trainer.MetricsFile.emit
    held = False

    def emit_then_hold(self, record) -> None:
        nonlocal held
        emit(self, record)
        if held or not isinstance(record.msg, dict):
            return
        lines = self.path.read_text().splitlines()
        if sum("train" in json.loads(x) for x in lines if x) >= rows:
            held = True
            os.kill(os.getpid(), signal.SIGSTOP)

    trainer.MetricsFile.emit = emit_then_hold


def hold_if_asked() -> None:
    if os.environ.get(HOLD):
        hold_at(int(os.environ[HOLD]))


if __name__ == "__main__":
    from pipeline.cli import run
    from pipeline.runtime.process_exit import run_then_exit

    hold_if_asked()
    run_then_exit(run)
