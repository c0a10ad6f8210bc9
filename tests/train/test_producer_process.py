"""pipeline/train/producer_process.py's pure parts: which GPUs a torchrun job's vllm engine gets, and the
environment its process starts with. (The process itself runs in tests/vllm/test_train_states_vllm.py, under
a real torchrun job on vLLM's CPU build.)"""

from __future__ import annotations

import pytest

from pipeline.errors import StageError
from pipeline.train.producer_process import engine_environment, engine_gpus, visible_gpu_ids


def test_the_engine_takes_the_gpus_after_the_trainers():
    visible = ["6", "7", "0", "1", "2", "3", "4", "5"]  # ops' order: the trainers' first
    assert engine_gpus(visible, 2, None) == ["0", "1", "2", "3", "4", "5"]
    assert engine_gpus(visible, 2, 4) == ["0", "1", "2", "3"]
    assert engine_gpus([], 2, None) == []  # no GPU: vLLM's CPU build


@pytest.mark.parametrize("visible, tp", [(["0", "1"], None), (["0", "1", "2"], 2), (["0", "1", "2"], 0)])
def test_too_few_gpus_for_the_engine_are_refused_in_one_line(visible, tp):
    with pytest.raises(StageError, match="runs on GPUs of its own") as err:
        engine_gpus(visible, 2, tp)
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
