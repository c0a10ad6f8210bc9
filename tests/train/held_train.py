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
    """Stop this process (SIGSTOP) right after the metrics row that makes ``rows`` training rows."""
    from pipeline.train import trainer

    emit = trainer.MetricsFile.emit

    def emit_then_hold(self, record) -> None:
        emit(self, record)
        lines = self.path.read_text().splitlines()
        if isinstance(record.msg, dict) and sum("train" in json.loads(x) for x in lines if x) >= rows:
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
