"""Reading many ``data_{i}.pt`` files fast, for checks that look at each file once and drop it (verify).

A ``SampleBuffer`` reads a whole file with one ``readinto`` into a buffer it keeps and reuses, then builds
the sample's tensors as views of that buffer: no page faults after the first file, no allocation, no
second copy. ``torch.load`` maps each file (page faults and unmaps that serialise a process's readers:
on a 32-core H200 host they stop gaining past 2-4 readers) or copies every record into fresh memory.
The views are valid until the next ``read`` on the same buffer: one buffer per reader thread. ``digest``
hashes the bytes the last ``read`` took in: verify's checksum check costs a hash pass, not another read.

It uses three methods of torch's own zip reader (``get_record``, ``has_record``, ``get_record_offset``:
present in torch 2.10, 2.11 and 2.13, which the tests and the H200 runs use; torch.load's own mmap path has
used them since 2.1, so the image's 2.9.1 has them too, not run here), and ``get_record_size`` to refuse a
storage record of another size than the pickle says, as torch.load does (where it is missing, every file
takes torch.load's path). Only what ``formats.write_sample``
writes takes this path: a little-endian torch zip whose pickle names ``_rebuild_tensor_v2``, typed storages
of the dtypes a sample holds and the empty hooks ``OrderedDict``, and whose tensors are contiguous from
offset 0 inside the file. Anything else, including any error of torch's reader, raises ``NotFastPath``, and
the caller loads the file with ``formats.read_sample``, whose findings (and errors) are then the ones
reported; so is every file when TORCH_FORCE_WEIGHTS_ONLY_LOAD is set. Each reader's buffer grows to the
largest file it has read (plus an eighth): 8 readers over 470 MB files (seq 8192, H 7168) hold ~4 GB until
verify returns.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
from pathlib import Path

import torch

from pipeline.ondisk import formats

_ZipReader = torch._C.PyTorchFileReader  # the reader torch.load uses; by name here so tests can age it
# the small records torch.load reads besides byteorder, the pickle and the storages: a file whose record here
# is damaged must not pass the fast path when torch.load (speculators' loader, train) cannot read it
_SMALL_RECORDS = (".format_version", ".storage_alignment", ".data/version", "version")
_DTYPES = {
    "BFloat16Storage": torch.bfloat16,
    "HalfStorage": torch.float16,
    "FloatStorage": torch.float32,
    "LongStorage": torch.int64,
}


class NotFastPath(Exception):
    """The file is not exactly what ``write_sample`` writes: load it with ``formats.read_sample``."""


class _View(io.RawIOBase):
    """A read-only file over a memoryview, for torch's zip reader (which reads the directory through it)."""

    def __init__(self, view: memoryview):
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: len(self._view)}[whence] + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        b[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


def _contiguous(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(size):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


class _Unpickler(pickle.Unpickler):
    """The C unpickler over one file's ``data.pkl``: storages become byte ranges of the buffer."""

    def __init__(self, pkl: bytes, reader, data: torch.Tensor):
        super().__init__(io.BytesIO(pkl))
        self._reader, self._data = reader, data

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise NotFastPath(f"{module}.{name}")

    def persistent_load(self, pid):
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], torch.dtype)
            and isinstance(pid[2], str)
            and isinstance(pid[4], int)
            and pid[4] >= 0
        ):
            raise NotFastPath("storage id")
        _, dtype, key, _, numel = pid
        record = f"data/{key}"
        nbytes = numel * dtype.itemsize
        if not self._reader.has_record(record):
            raise NotFastPath(f"no record {record}")
        size_of = getattr(self._reader, "get_record_size", None)
        if size_of is None:
            raise NotFastPath("torch's zip reader has no get_record_size")
        if size_of(record) != nbytes:  # torch.load refuses a storage of another size than its pickle says
            raise NotFastPath(f"record {record} holds {size_of(record)} bytes, the pickle {nbytes}")
        start = self._reader.get_record_offset(record)
        if start + nbytes > self._data.numel():  # the view stays inside this file's bytes
            raise NotFastPath(f"record {record} past the end")
        return self._data[start : start + nbytes].view(dtype)


def _rebuild(storage, offset, size, stride, requires_grad=False, hooks=None, *_):
    size, stride = tuple(size), tuple(stride)
    if (
        offset != 0
        or stride != _contiguous(size)
        or math.prod(size) > storage.numel()
        or requires_grad
        or hooks
    ):
        raise NotFastPath("tensor layout")
    return storage[: math.prod(size)].view(size)


class SampleBuffer:
    """One reader's buffer: ``read(path)`` returns the sample as views that the next ``read`` overwrites."""

    def __init__(self):
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._size = 0

    def digest(self) -> formats.FileDigest:
        """The sha256 and size of the bytes the last ``read`` took in (the file's checksum, no second
        read)."""
        return formats.FileDigest(
            hashlib.sha256(memoryview(self._buffer.numpy())[: self._size]).hexdigest(), self._size
        )

    def read(self, path: Path) -> dict:
        if formats.weights_only_forced():
            raise NotFastPath("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
        with open(path, "rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            if self._buffer.numel() < size:
                self._buffer = torch.empty(size + (size >> 3), dtype=torch.uint8)  # headroom: lengths vary
            view = memoryview(self._buffer.numpy())[:size]
            done = 0
            while done < size and (n := fh.readinto(view[done:])):
                done += n
        if done != size:
            raise NotFastPath("file changed while read")
        self._size = size
        try:
            reader = _ZipReader(_View(view))
            if reader.get_record("byteorder") != b"little":
                raise NotFastPath("byte order")
            for name in _SMALL_RECORDS:  # read by torch.load first: a damaged one fails it, so it fails here
                if reader.has_record(name):
                    record = reader.get_record(name)
                    if name == ".storage_alignment":  # torch.load parses it (int()): so must its value here
                        int(record)
            return _Unpickler(reader.get_record("data.pkl"), reader, self._buffer[:size]).load()
        except NotFastPath:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever this path cannot read, torch.load decides about
            raise NotFastPath(f"{type(exc).__name__}: {exc}") from exc
