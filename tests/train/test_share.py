"""The vllm states producer's share of GPU memory beside the trainer (pipeline/train/share.py): pure."""

from __future__ import annotations

import pytest

from pipeline.errors import StageError
from pipeline.train.share import HEADROOM, HIGHEST, LOWEST, UNKNOWN, producer_share

GIB = 2**30
H200 = 140 * GIB


def test_a_trainer_on_the_engines_gpu_gets_what_the_share_leaves():
    """The weights' share of each GPU plus the headroom, within the bounds: a 3 GiB model on one H200 gets
    the lowest share, Kimi-K2.5's ~595 GB over 8 cards of 96 GB the highest, a 60 GiB model on one H200 its
    weights' share + headroom."""
    small = producer_share(None, "vllm", 0, 1, 3 * GIB, H200)
    assert small.value == LOWEST and "shared with the trainer on GPU 0" in small.reason
    kimi = producer_share(None, "vllm", 0, 8, 595 * 10**9, 96 * GIB)
    assert kimi.value == HIGHEST
    mid = producer_share(None, "vllm", 0, 1, 60 * GIB, H200)
    assert mid.value == round(60 / 140 + HEADROOM, 2) and LOWEST < mid.value < HIGHEST
    assert producer_share(None, "vllm", 0, 1, None, H200).value == UNKNOWN


def test_a_trainer_with_a_gpu_of_its_own_leaves_vllms_default():
    """Trainer on cuda:6 past an engine of 6 GPUs, or on the CPU: no share set (vLLM's own)."""
    assert producer_share(None, "vllm", 6, 6, 3 * GIB, H200).value is None
    assert producer_share(None, "vllm", None, 1, 3 * GIB, H200).value is None
    assert producer_share(0.6, "vllm", 6, 6, None, None).value == 0.6  # asked wins


@pytest.mark.parametrize(
    "asked, backend, message",
    [
        (0.0, "vllm", "between 0 and 1"),
        (1.0, "vllm", "between 0 and 1"),
        (0.5, "hf", "the hf backend produces here"),
    ],
)
def test_a_share_out_of_range_or_for_hf_is_one_line(asked, backend, message):
    with pytest.raises(StageError, match=message) as err:
        producer_share(asked, backend, 0, 1, None, None)
    assert "\n" not in str(err.value)


def test_a_torchrun_jobs_engine_shares_only_where_it_spans_the_trainers_gpus(monkeypatch, tmp_path):
    """The train stage's glue (pipeline/train/produced.py ``memory_share``) on an 8-GPU host: a torchrun job's
    engine over the trainers' 8 GPUs gets the share (rank 0 trains on cuda:0, one of the engine's), the same
    engine on 6 GPUs of its own after 2 trainers vLLM's default."""
    import pipeline.backends.base as base
    import pipeline.backends.choice as choice
    from pipeline.train.config import TrainConfig
    from pipeline.train.producer_process import Placement
    from pipeline.train.produced import memory_share

    monkeypatch.setattr(base, "visible_device_count", lambda: 8)
    monkeypatch.setattr(choice, "weights_bytes", lambda path: 595 * 10**9)
    monkeypatch.setattr(choice, "gpu_memory_bytes", lambda: 96 * GIB)
    cfg = TrainConfig(
        data=tmp_path,
        verifier=tmp_path,
        out=tmp_path / "out",
        states_mode="online",
        states_budget="1T",
        prepared=tmp_path,
        model=tmp_path,
    )
    shared = memory_share(cfg, "vllm", tmp_path, Placement(tuple("01234567"), shared=True))
    assert shared.value == HIGHEST and "shared with the trainer on GPU 0" in shared.reason
    own = memory_share(cfg, "vllm", tmp_path, Placement(tuple("234567")))
    assert own.value is None and "no GPU of the engine's" in own.reason
