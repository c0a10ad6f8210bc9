"""Issue #50 item 2: every disk-full error says "disk full" and names the path, whatever wrote (the OS,
numpy's and torch's short writes "N requested and M written" with no error code, safetensors' wrapper), at
the shared write path (pipeline/ondisk/atomic.py `write_error`, used by `atomic_path`, `outdir.staged_dir`
and `writing`). Real small tmpfs mounts: the library writers themselves, and each writing stage through a
real process (prepare's short write, train's checkpoint, verify's summary; extract, weights and train's
first file in test_faults.py and test_reliability_classes.py). Nothing half-written is left."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.ondisk.atomic import DiskFull, atomic_path
from tests.conftest import run_pipeline, tmpfs


def _npy(tmp: Path) -> None:
    with open(tmp, "wb") as fh:  # as formats._save_npy writes: numpy's tofile, a short write on a full disk
        np.save(fh, np.zeros(100_000))


def _torch(tmp: Path) -> None:
    with open(tmp, "wb") as fh:  # torch's zip writer: "unexpected pos ..." with no error code
        torch.save({"x": torch.zeros(100_000)}, fh)


def _safetensors(tmp: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(100_000)}, str(tmp))  # SafetensorError "... (os error 28)"


WRITERS = {"numpy": _npy, "torch": _torch, "safetensors": _safetensors}


def fill(mnt: Path) -> None:
    """Fill the file system at ``mnt`` up to its last byte with one file."""
    with open(mnt / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def one_line(proc) -> str:
    err = proc.stderr.strip()
    assert err and "Traceback" not in err, proc.stdout + proc.stderr
    return err.splitlines()[-1]


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_library_writer_on_a_full_disk_is_disk_full_naming_the_file(tmp_path, writer):
    """800 KB written by numpy, torch or safetensors into a 64 KiB tmpfs through atomic_path: DiskFull
    (ENOSPC) naming the target, its reason "disk full: No space left on device"; the partial file is gone
    (before: numpy's "100000 requested and 8176 written" and torch's "unexpected pos 704 vs 598" named no
    path and did not say the disk was full)."""
    with tmpfs(tmp_path / "disk", "64k") as mnt:
        target = mnt / "out.bin"
        with pytest.raises(DiskFull) as info:
            with atomic_path(target) as tmp:
                WRITERS[writer](tmp)
        exc = info.value
        assert exc.errno == errno.ENOSPC and exc.filename == str(target), (exc, exc.__cause__)
        assert exc.strerror == "disk full: No space left on device", exc.strerror
        assert list(mnt.iterdir()) == []


def test_a_short_write_with_room_left_is_not_called_disk_full(tmp_path):
    """Control: a short write where the file system has room (a cut pipe, a device error) names the file as a
    short write, and does not claim the disk is full."""
    target = tmp_path / "out.bin"
    with pytest.raises(OSError) as info:
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"x")
            raise OSError("100 requested and 10 written")
    exc = info.value
    assert not isinstance(exc, DiskFull) and exc.errno == errno.EIO and exc.filename == str(target), exc
    assert exc.strerror == "short write (100 requested and 10 written)", exc.strerror
    assert list(tmp_path.iterdir()) == []


def test_prepare_short_write_is_disk_full_naming_the_file(tmp_path, tiny_llama, conversations):
    """prepare into a 16 KiB tmpfs: tokens.npy (27 KB) is cut by numpy's short write; one line naming
    OUT/tokens.npy and "disk full", exit 2, nothing left (before: "file operation failed: 26572 requested and
    ... written (check the path, then re-run)")."""
    with tmpfs(tmp_path / "disk", "16k") as mnt:
        out = mnt / "p"
        proc = run_pipeline(
            "prepare", "--data", conversations, "--model", tiny_llama, "--out", out,
            "--seq-length", "128", "--draft-vocab-size", "128",
        )  # fmt: skip
        line = one_line(proc)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert line.startswith(f"error: file operation failed {out}/tokens.npy: disk full: "), line
        assert list(mnt.iterdir()) == []


def test_train_checkpoint_on_a_full_disk_is_disk_full_naming_it(tmp_path, tiny_llama, extracted_llama):
    """train into a 2 MiB tmpfs: the verifier copy (1 MiB) fits, the first checkpoint (5 MB) does not; one
    line naming OUT/checkpoints/0 and "disk full", exit 2; the --out this run made is gone (before: a
    SafetensorError traceback)."""
    from pipeline.weights import run as weights

    weights(tiny_llama, tmp_path / "v")
    with tmpfs(tmp_path / "disk", "2m") as mnt:
        out = mnt / "tr"
        proc = run_pipeline(
            "train", "--data", extracted_llama, "--verifier", tmp_path / "v", "--out", out,
            "--epochs", "1", "--no-eval", "--no-plots", "--max-len", "64",
        )  # fmt: skip
        line = one_line(proc)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert line.startswith(f"error: file operation failed {out}/checkpoints/0: "), line
        assert "disk full: No space left on device" in line, line
        assert list(mnt.iterdir()) == []


def test_verify_summary_on_a_full_disk_is_disk_full_naming_it(tmp_path, prepared_llama):
    """verify of a prepared set whose file system is full: the checks run, the summary it writes next to the
    set does not fit; one line naming DIR/summary.json and "disk full", exit 2, no temp file beside it."""
    with tmpfs(tmp_path / "disk", "256k") as mnt:
        d = mnt / "prep"
        shutil.copytree(prepared_llama, d)
        (d / "summary.json").unlink(missing_ok=True)
        fill(mnt)
        proc = run_pipeline("verify", d)
        line = one_line(proc)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert line.startswith(f"error: file operation failed {d}/summary.json: disk full: "), line
        assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in prepared_llama.iterdir())
