"""pipeline/train/producer_process.py: which GPUs a torchrun job's vllm engine gets and the environment its
process starts with (pure), and the process with rank 0 a real process that is killed or stops it (the hf
backend). Under a real torchrun job on vLLM's CPU build: tests/vllm/test_train_states_vllm.py."""

from __future__ import annotations

import pytest

from pipeline.errors import StageError
from pipeline.train.producer_process import (
    Placement,
    engine_environment,
    engine_placement,
    visible_gpu_ids,
)


def test_the_engine_takes_the_gpus_after_the_trainers():
    visible = ["6", "7", "0", "1", "2", "3", "4", "5"]  # ops' order: the trainers' first
    assert engine_placement(visible, 2, None) == Placement(("0", "1", "2", "3", "4", "5"))
    assert engine_placement(visible, 2, 4) == Placement(("0", "1", "2", "3"))
    assert engine_placement([], 2, None) == Placement(())  # no GPU: vLLM's CPU build


def test_where_the_trainers_took_every_gpu_the_engine_shares_them():
    """The Kimi plan's first split: 8 trainer processes, the engine tensor parallel 8 on the same GPUs."""
    visible = [str(i) for i in range(8)]
    assert engine_placement(visible, 8, None) == Placement(tuple(visible), shared=True)
    assert engine_placement(visible, 8, 4) == Placement(("0", "1", "2", "3"), shared=True)
    with pytest.raises(StageError, match="shares the trainers' 8 GPU.s. here: give at most 8"):
        engine_placement(visible, 8, 16)


TOO_FEW = [(["0", "1", "2"], 2), (["0", "1", "2"], 0), (["0", "1", "2", "3"], 3)]


@pytest.mark.parametrize("visible, tp", TOO_FEW)
def test_too_few_gpus_left_for_the_engine_are_refused_in_one_line(visible, tp):
    with pytest.raises(StageError, match="runs on the GPUs after the 2 trainer processes'") as err:
        engine_placement(visible, 2, tp)
    assert "\n" not in str(err.value) and "--states-tensor-parallel-size" in str(err.value)


def test_visible_ids_follow_cuda_visible_devices():
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "6, 7,0"}, 3) == ["6", "7", "0"]
    assert visible_gpu_ids({}, 3) == ["0", "1", "2"]
    assert visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "6,7"}, 0) == []


def test_the_engines_environment_has_nothing_of_torchruns():
    rank = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "GROUP_RANK": "0",
        "ROLE_RANK": "0",
        "ROLE_NAME": "default",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "x",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "CUDA_VISIBLE_DEVICES": "6,7,0,1",
        "PATH": "/usr/bin",
        "HF_HOME": "/cache",
    }
    env = engine_environment(rank, ["0", "1"])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/usr/bin", "HF_HOME": "/cache"}
    assert engine_environment({"RANK": "1", "PATH": "/bin"}, []) == {"PATH": "/bin"}


def vllm_placement(monkeypatch, gpus: int, producer: str, world: int = 1, tp=None, device="cuda:0"):
    """pipeline/train/produced.py's choice for a vllm producer of a ``world``-rank run, on a faked host of
    ``gpus`` GPUs."""
    from types import SimpleNamespace

    from pipeline.train import produced

    monkeypatch.setattr("pipeline.backends.base.visible_device_count", lambda: gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = SimpleNamespace(states_producer=producer, states_tensor_parallel_size=tp, device=device)
    return produced.engine_placement(cfg, "vllm", world)


def test_one_process_runs_its_engine_in_a_process_unless_asked_for_a_thread(monkeypatch):
    """In one process (auto or process): the GPUs the engine's thread would take (the first
    --states-tensor-parallel-size visible, else all), shared when the trainer's --device is one of them."""
    assert vllm_placement(monkeypatch, 1, "thread") is None
    assert vllm_placement(monkeypatch, 1, "auto") == Placement(("0",), shared=True)
    assert vllm_placement(monkeypatch, 1, "process") == Placement(("0",), shared=True)
    assert vllm_placement(monkeypatch, 8, "process", tp=6, device="cuda:6") == Placement(
        ("0", "1", "2", "3", "4", "5")
    )
    assert vllm_placement(monkeypatch, 8, "process", tp=6, device="cuda:2").shared
    assert vllm_placement(monkeypatch, 0, "process", device="cpu") == Placement(())
    # a torchrun job's engine is a process whatever auto says
    assert vllm_placement(monkeypatch, 8, "auto", world=2) == Placement(("2", "3", "4", "5", "6", "7"))


def test_a_thread_engine_under_torchrun_is_refused_in_one_line(monkeypatch):
    with pytest.raises(StageError, match="--states-producer thread under torchrun.*hangs") as err:
        vllm_placement(monkeypatch, 8, "thread", world=2)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- the process, with rank 0 a real process

RANK0 = """
import json, os, sys, time
from pathlib import Path
from pipeline.backends.base import BackendOptions
from pipeline.model.modeldir import read_model_dir
from pipeline.ondisk import formats
from pipeline.train import states
from pipeline.train.producer_process import ProducerProcess

model, prepared, directory, then = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
config = json.loads((model / "config.json").read_text())
layers = (0, 1, config["num_hidden_layers"] - 1)
options = BackendOptions(model=read_model_dir(model), layer_ids=layers, device="cpu", dtype="float32")
samples, _ = formats.read_prepared(prepared)
lengths = [int(n) for n in samples.lengths()]
sizes = tuple(states.sample_bytes(n, config["hidden_size"], len(layers), 4) for n in lengths)
room = sizes[0] + sizes[1]  # two files, then the producer waits for a reader that never comes
plan = states.StatesPlan("online", room, frozenset(), 0, room)
order = tuple(range(len(lengths)))
schedule = states.Schedule(order, plan, sizes, frozenset(), 0, config["hidden_size"], len(layers), 10**6, 1)
producer = ProducerProcess("hf", options, os.environ).start()
producer.produce(directory, prepared, schedule)
states.wait_for(formats.data_file(directory, 1), directory, timeout=120)
print(producer._proc.pid, flush=True)
if then == "stop":
    producer.stop()
else:
    time.sleep(600)  # killed here
"""


@pytest.mark.parametrize("then", ["killed", "stop"])
def test_rank0_killed_marks_the_states_dir_failed_for_the_other_ranks_readers(stage_inputs, tmp_path, then):
    """Rank 0 (a real process here, the hf backend in its producer's process) SIGKILLed while the producer
    waits for room: the producer's process marks the states dir failed before it closes, so that another
    rank's reader waiting for a file that will never come ends in one line, and it exits. Rank 0 that asks
    it to stop leaves no such mark. (Under torchrun, a vllm engine: tests/vllm/test_train_states_vllm.py.)"""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from pipeline.ondisk import formats
    from pipeline.train import states
    from tests.train.states_helpers import SAMPLES

    directory = tmp_path / "states"
    directory.mkdir()
    args = [stage_inputs["model"], stage_inputs["prepared"], directory, then]
    rank0 = subprocess.Popen(
        [sys.executable, "-c", RANK0, *map(str, args)], stdout=subprocess.PIPE, text=True
    )
    try:
        child = psutil.Process(int(rank0.stdout.readline()))
        if then == "killed":
            os.kill(rank0.pid, signal.SIGKILL)
        assert rank0.wait(timeout=120) == (-signal.SIGKILL if then == "killed" else 0)
        child.wait(timeout=60)  # it closes its engine and exits either way
    finally:
        rank0.kill()
    last = formats.data_file(directory, SAMPLES - 1)  # past the two files the budget let it write
    assert not last.exists()
    if then == "killed":
        with pytest.raises(StageError, match="the states producer failed: rank 0's process ended"):
            states.wait_for(last, directory, timeout=30)
    else:
        assert not (directory / states.FAILED).exists()
