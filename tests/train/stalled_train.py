"""``python -m tests.train.stalled_train STAGE ...``: ``python -m pipeline`` with rank 0's states producer
stalled before its first file, for the test of a rank orphaned by a killed rank 0 and agent
(tests/train/test_data_parallel.py). With ``STALL_MARKERS`` (a folder) in the environment:

* the producer thread writes ``producer`` there and then produces nothing until it is stopped, so every
  rank's first read waits for a file that will not come;
* each rank's first wait for a state file writes ``waiting-rank{RANK}`` there, so that the test kills
  rank 0 only once the other rank is inside that wait (not in a collective, which gloo would end itself);
* ``STALL_STALE_S`` replaces ``states.STALE_S``, the silence after which a waiting reader asks whether
  rank 0's process is gone."""

from __future__ import annotations

import os
from pathlib import Path

MARKERS = "STALL_MARKERS"
STALE = "STALL_STALE_S"


def stall_producer(markers: Path) -> None:
    from pipeline.train import states

    def stalled(self) -> None:
        (markers / "producer").write_text(f"{os.getpid()}\n")
        self._stop.wait()

    wait_for = states.wait_for

    def noted_wait(path, directory, *args, **kwargs):
        mark = markers / f"waiting-rank{os.environ.get('RANK', '0')}"
        if not mark.exists():
            mark.write_text(f"{os.getpid()} {Path(path).name}\n")
        return wait_for(path, directory, *args, **kwargs)

    states.Producer._run = stalled
    states.wait_for = noted_wait
    if os.environ.get(STALE):
        states.STALE_S = float(os.environ[STALE])


if __name__ == "__main__":
    from pipeline.cli import run
    from pipeline.runtime.process_exit import run_then_exit

    if os.environ.get(MARKERS):
        stall_producer(Path(os.environ[MARKERS]))
    run_then_exit(run)
