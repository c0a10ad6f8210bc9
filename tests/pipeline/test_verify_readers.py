"""verify's reader count: 8 by default, fewer with fewer cores, and never so many that the readers'
buffers (each as large as the largest file) would take over a quarter of the memory available."""

from __future__ import annotations

import os
from concurrent import futures

import pytest
import torch

from pipeline import verify

from pipeline.ondisk import formats
from pipeline.ondisk import integrity
from pipeline.ondisk.integrity import available_memory, default_workers
from pipeline.verify import VerifyConfig

FILE = 470_000_000  # seq 8192 x hidden 7168 x 4 layers x bf16


def test_plenty_of_memory_keeps_the_core_bound():
    assert default_workers() == default_workers(FILE, 10**13) == max(1, min(8, os.cpu_count() or 1))


@pytest.mark.parametrize("quarter_fits,expected", [(3, 3), (1, 1), (0, 1)])
def test_tight_memory_lowers_the_readers_but_never_to_zero(monkeypatch, quarter_fits, expected):
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    assert default_workers(FILE, 4 * FILE * quarter_fits + 4 * FILE // 2) == expected


def test_available_memory_reads_the_kernels_figure():
    got = available_memory()
    assert got is not None and 0 < got <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_verify_reads_with_the_bounded_count(monkeypatch, tmp_path):
    """The bound reaches the thread pool verify builds (0 = default), and an explicit --workers wins."""
    out = tmp_path / "hs"
    out.mkdir()
    dc = formats.DataConfig(
        model="m",
        layer_ids=[0, 1, 2, 3],
        num_layers=4,
        hidden_size=8,
        dtype="bfloat16",
        num_samples=1,
        seq_length=16,
        prepared="",
        backend="hf",
    )
    formats.write_data_config(out, dc)
    # one file: a set that selects none is a failed check before any reader starts
    formats.write_sample(
        formats.data_file(out, 0),
        torch.arange(4),
        [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(4)],
        torch.ones(4, dtype=torch.int64),
    )
    per_file = 16 * 8 * 4 * 2
    monkeypatch.setattr(integrity, "available_memory", lambda: 4 * per_file * 2)  # room for two buffers
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    seen = []
    real = futures.ThreadPoolExecutor
    monkeypatch.setattr(
        verify, "ThreadPoolExecutor", lambda max_workers: seen.append(max_workers) or real(max_workers)
    )
    verify.verify(VerifyConfig(path=out, write_summary=False))
    verify.verify(VerifyConfig(path=out, workers=5, write_summary=False))
    assert seen == [2, 5]
