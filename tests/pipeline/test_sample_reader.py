"""formats.read_sample: the restricted C unpickler reads what write_sample wrote, and nothing else runs.

The "payload" below is a pickle whose loading would create a marker file; every refusal is checked both
by the exception and by the marker's absence, so a loader that ran the payload fails even if it raised.
"""

from __future__ import annotations

import os

import pytest
import torch

from pipeline.ondisk import formats
from pipeline.ondisk.sample_buffer import NotFastPath, SampleBuffer
from pipeline.verify import VerifyConfig, verify


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _sample(dtype):
    return (
        torch.arange(7),
        [torch.randn(7, 16).to(dtype) for _ in range(4)],
        torch.tensor([0, 0, 1, 1, 1, 0, 1]),
    )


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
    torch.save(
        {"input_ids": ids, "hidden_states": hs, "loss_mask": mask, "x": _Payload(marker)},
        tmp_path / "data_0.pt",
        _use_new_zipfile_serialization=not legacy,
    )
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
    assert failed == {("data_2.pt", "loadable"), ("data_2.pt", "checksum")}
    assert not marker.exists()


# ---------------------------------------------------- verify's buffer path (pipeline/ondisk/sample_buffer.py)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_buffer_reads_what_write_sample_wrote_and_reuses_its_memory(tmp_path, dtype):
    buffer = SampleBuffer()
    samples = []
    for i, t in enumerate((9, 40, 5)):  # growing, then shrinking: the buffer is reused, never stale
        ids, hs = torch.arange(t) * (i + 1), [torch.randn(t, 16).to(dtype) for _ in range(4)]
        mask = (torch.arange(t) % 2).to(torch.int64)
        formats.write_sample(tmp_path / f"data_{i}.pt", ids, hs, mask)
        samples.append((ids, hs, mask))
    for i, (ids, hs, mask) in enumerate(samples):
        got = buffer.read(tmp_path / f"data_{i}.pt")
        assert list(got) == list(formats.DATA_KEYS)
        assert torch.equal(got["input_ids"], ids) and torch.equal(got["loss_mask"], mask)
        assert [h.dtype for h in got["hidden_states"]] == [dtype] * 4
        assert all(torch.equal(a, b) for a, b in zip(got["hidden_states"], hs))
        # views of the buffer, not copies: nothing allocated per file
        assert (
            got["hidden_states"][0].untyped_storage().data_ptr()
            == buffer._buffer.untyped_storage().data_ptr()
        )


def _record_data_offset(path, suffix: str) -> int:
    """Where the stored (uncompressed) bytes of the zip record whose name ends in ``suffix`` begin."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as fh:
        fh.seek(info.header_offset)
        header = fh.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _save(path, obj, **kwargs):
    torch.save(obj, path, **kwargs)
    return path


@pytest.mark.parametrize(
    "case",
    [
        "non_contiguous",
        "offset_view",
        "other_global",
        "legacy",
        "truncated",
        "not_zip",
        "forced",
        "alignment_value",
    ],
)
def test_buffer_refuses_anything_write_sample_does_not_write(tmp_path, monkeypatch, case):
    """Each of these goes to formats.read_sample instead (NotFastPath), which then loads or reports it."""
    ids, hs, mask = _sample(torch.bfloat16)
    sample = {"input_ids": ids, "hidden_states": hs, "loss_mask": mask}
    path = tmp_path / "data_0.pt"
    if case == "non_contiguous":
        sample["hidden_states"] = [h.t() for h in hs]
        _save(path, sample)
    elif case == "offset_view":
        base = torch.randn(20, 16).to(torch.bfloat16)
        sample["hidden_states"] = [
            base[3:10] for _ in hs
        ]  # a view: storage larger than the tensor, offset 3*16
        _save(path, sample)
    elif case == "other_global":
        sample["x"] = _Payload(tmp_path / "ran")
        _save(path, sample)
    elif case == "legacy":
        _save(path, sample, _use_new_zipfile_serialization=False)
    elif case == "truncated":
        formats.write_sample(path, ids, hs, mask)
        path.write_bytes(path.read_bytes()[:-200])
    elif case == "not_zip":
        path.write_bytes(b"\0" * 4096)
    elif case == "forced":
        formats.write_sample(path, ids, hs, mask)
        monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    elif case == "alignment_value":  # one byte of a record's value, which the zip reader does not check
        formats.write_sample(path, ids, hs, mask)
        data = bytearray(path.read_bytes())
        at = _record_data_offset(path, ".storage_alignment")
        data[at] = 0  # b"64" -> b"\x004": torch.load's int() of it fails (a hypothesis case of 2026-12-05)
        path.write_bytes(bytes(data))
        with pytest.raises(ValueError, match="invalid literal for int"):
            formats.read_sample(path)
    with pytest.raises(NotFastPath):
        SampleBuffer().read(path)
    assert not (tmp_path / "ran").exists()
    if case in ("non_contiguous", "offset_view", "forced"):  # valid files: the fallback still reads them
        got = formats.read_sample(path)
        assert torch.equal(got["hidden_states"][0], sample["hidden_states"][0])


def test_verify_falls_back_for_valid_files_the_buffer_does_not_take(tmp_path, extracted_llama):
    """A data file saved with non-contiguous states still verifies (through torch.load), and a truncated one
    is still a loadable finding."""
    import shutil

    d = tmp_path / "states"
    shutil.copytree(extracted_llama, d)
    sample = formats.read_sample(d / "data_4.pt")
    sample["hidden_states"] = [
        h.t().contiguous().t() for h in sample["hidden_states"]
    ]  # same values, column-major
    torch.save(sample, d / "data_4.pt")
    (d / formats.CHECKSUMS).unlink()  # rewritten on purpose: its recorded checksum no longer applies
    with pytest.raises(NotFastPath):
        SampleBuffer().read(d / "data_4.pt")
    assert verify(VerifyConfig(path=d, write_summary=False)).ok
    (d / "data_6.pt").write_bytes((d / "data_6.pt").read_bytes()[:1000])
    summary = verify(VerifyConfig(path=d, write_summary=False))
    assert {(c.file, c.name) for c in summary.checks if c.status == "fail"} == {("data_6.pt", "loadable")}


def test_a_zip_reader_without_a_method_the_buffer_uses_falls_back(monkeypatch, extracted_llama):
    """torch 2.11's reader lacked a method that 2.13's has; the buffer path must then fall back, never turn
    every file into a finding (what the first H200 run of this code did)."""
    from pipeline.ondisk import sample_buffer

    real = sample_buffer._ZipReader

    class Older:
        def __init__(self, f):
            self._real = real(f)

        def __getattr__(self, name):
            if name == "get_record_offset":
                raise AttributeError(name)
            return getattr(self._real, name)

    monkeypatch.setattr(sample_buffer, "_ZipReader", Older)
    with pytest.raises(NotFastPath, match="AttributeError"):
        SampleBuffer().read(extracted_llama / "data_0.pt")
    assert verify(VerifyConfig(path=extracted_llama, write_summary=False)).ok
