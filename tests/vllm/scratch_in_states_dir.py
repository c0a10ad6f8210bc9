"""``python -m tests.vllm.scratch_in_states_dir STAGE ...``: ``python -m pipeline`` with the vllm backend's
per-request files in the output dir (``--data`` for train's producer), as on a host whose /dev/shm has no
room for them (pipeline/backends/vllm_scratch.py ``choose``). The tests of what a killed run leaves there and
of the budget over those files run the stage through this; nothing else does. It holds at a step as
tests/train/held_train.py does, where asked."""

from __future__ import annotations

from pathlib import Path

from pipeline.backends import vllm_scratch

NO_SHM = Path("/nonexistent-shm")  # choose() finds no shared memory there: the output dir it is
_choose = vllm_scratch.choose


def choose_out(out: Path, need: int, shm: Path = NO_SHM) -> vllm_scratch.Choice:
    return _choose(out, need, NO_SHM)


if __name__ == "__main__":
    from pipeline.cli import run
    from pipeline.runtime.process_exit import run_then_exit

    from tests.train.held_train import hold_if_asked

    vllm_scratch.choose = choose_out
    hold_if_asked()
    run_then_exit(run)
