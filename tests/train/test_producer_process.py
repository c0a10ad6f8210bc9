"""pipeline/train/producer_process.py's pure parts: which GPUs a torchrun job's vllm engine gets, and the
environment its process starts with. (The process itself runs in tests/vllm/test_train_states_vllm.py, under
a real torchrun job on vLLM's CPU build.)"""

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
