"""A hybrid `pipeline train --device cuda` SIGKILLed on a GPU, then resumed (issue #31 item 5, the kill on
the H200): what tests/train/test_states.py proves on the CPU, plus that the killed run leaves no process on
the GPU.

    python3 -m pytest -m gpu -p no:cacheprovider tests/train/test_states_kill_gpu.py

The trainer and the hf producer both run on the GPU (``--device cuda``, ``--states-device cuda``), the states
in fp32 as the CPU reference's, so the budget sized from its files holds part of the set. NVML is
sampled while the first run trains: its pid must show up among the GPU's compute processes (else the check
after the kill would prove nothing), and none of its processes may be there once it was killed. The resumed
draft is compared with the CPU's offline run on the same data and seed by its last training loss, within 1%
relative: the GPU's kernels (cuBLAS, fused loss) do not reproduce the CPU's sums bit for bit, and an epoch
trained twice, or a step skipped, moves the tiny draft's loss by far more.
"""

from __future__ import annotations

import signal

import pytest
import torch

from tests.train.states_helpers import (
    EPOCHS,
    GpuPidWatch,
    assert_recovered,
    budget_for,
    gpu_pids,
    interrupt_then_resume,
    states_config,
    train_losses,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_sigkill_on_the_gpu_then_resume(stage_inputs, offline, tmp_path):
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (the gpu marker: run it on a GPU host)"
    ref = offline["cfg"]
    cfg = states_config(
        stage_inputs,
        tmp_path / "states",
        tmp_path / "out",
        states_mode="hybrid",
        states_budget=budget_for(ref.data, held=8),  # as the CPU hybrid kill test: part of the set
        states_max_batch_size=1,
        checkpoint_steps=1,
        device="cuda",
        states_device="cuda",
        states_dtype="float32",  # the CPU's file sizes, which the budget was sized from (bf16: half of them)
    )
    steps = offline["summary"]["train"]["steps_per_epoch"]
    with GpuPidWatch() as watch:
        result = interrupt_then_resume(cfg, [(signal.SIGKILL, steps + 2)], timeout=300)
    (killed,) = result["stops"]
    ours = {killed["proc"].pid, *killed["children"]}
    assert killed["proc"].pid in watch.seen, (killed["proc"].pid, watch.seen)  # it did run on the GPU
    assert not ours & gpu_pids(), "a process of the killed run still holds the GPU"
    assert steps + 2 <= killed["rows"] < EPOCHS * steps, f"kill landed outside epoch 1 ({killed['rows']})"
    summary = assert_recovered(cfg, result, EPOCHS * steps)
    # the budget bit: part of the set was produced again each epoch, not all of it kept after the first
    assert summary["train"]["states"]["kept_samples"] < len(list(ref.data.glob("data_*.pt"))), summary
    assert summary["train"]["device"].startswith("cuda"), summary["train"]["device"]
    gpu, cpu = train_losses(cfg.out)[-1], train_losses(ref.out)[-1]
    print(f"\nlast train loss: GPU resumed {gpu:.6f}, CPU offline {cpu:.6f}")
    assert abs(gpu - cpu) <= 1e-2 * abs(cpu), (gpu, cpu)
