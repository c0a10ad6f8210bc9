"""formats.read_sample: the restricted C unpickler reads what write_sample wrote, and nothing else runs.

The "payload" below is a pickle whose loading would create a marker file; every refusal is checked both
by the exception and by the marker's absence, so a loader that ran the payload fails even if it raised.
"""

from __future__ import annotations

import os

import pytest
import torch

from pipeline import formats
from pipeline.verify import VerifyConfig, verify


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _sample(dtype):
    return (torch.arange(7), [torch.randn(7, 16).to(dtype) for _ in range(4)], torch.tensor([0, 0, 1, 1, 1, 0, 1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mmap", [False, True])
def test_reads_back_what_write_sample_wrote(tmp_path, dtype, mmap):
    ids, hs, mask = _sample(dtype)
    formats.write_sample(tmp_path / "data_0.pt", ids, hs, mask)
    got = formats.read_sample(tmp_path / "data_0.pt", mmap=mmap)
    assert list(got) == list(formats.DATA_KEYS)
    assert torch.equal(got["input_ids"], ids) and torch.equal(got["loss_mask"], mask)
    assert len(got["hidden_states"]) == 4
    for a, b in zip(got["hidden_states"], hs):
        assert a.dtype == dtype and torch.equal(a, b)


@pytest.mark.parametrize("forced", [False, True], ids=["restricted", "weights_only_forced"])
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_file_naming_any_other_global_is_refused_without_running_it(tmp_path, monkeypatch, forced, legacy):
    if forced:
        monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "ran"
    ids, hs, mask = _sample(torch.bfloat16)
    torch.save({"input_ids": ids, "hidden_states": hs, "loss_mask": mask, "x": _Payload(marker)},
               tmp_path / "data_0.pt", _use_new_zipfile_serialization=not legacy)
    with pytest.raises(Exception) as info:
        formats.read_sample(tmp_path / "data_0.pt")
    assert not marker.exists()
    if not forced:
        assert ("mkdir is not part of a data file" in str(info.value)) != legacy
        assert ("legacy or foreign format" in str(info.value)) == legacy


def test_verify_reports_such_a_file_as_not_loadable(tmp_path, extracted_llama):
    import shutil

    d = tmp_path / "states"
    shutil.copytree(extracted_llama, d)
    marker = tmp_path / "ran"
    sample = formats.read_sample(d / "data_2.pt")
    sample["hidden_states"].append(_Payload(marker))
    torch.save(sample, d / "data_2.pt")
    summary = verify(VerifyConfig(path=d, write_summary=False))
    failed = {(c.file, c.name) for c in summary.checks if c.status == "fail"}
    assert failed == {("data_2.pt", "loadable")}
    assert not marker.exists()
