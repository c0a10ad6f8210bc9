#!/usr/bin/env python3
"""Which GPU architectures a compiled CUDA library carries, read from its ELF ``.nv_fatbin`` section.

Owns the parsing of NVIDIA fat binaries embedded in shared objects (vLLM's ``_C.abi3.so``, torch's
``libtorch_cuda.so``): every entry names its kind (2 = SASS/cubin, 1 = PTX) and its SM version (90 for
sm_90/sm_90a, 120 for sm_120). Only cubins count as "runs on that GPU without a JIT"; PTX is listed
separately. Reads headers only, never decompresses code, needs no GPU, no CUDA toolkit and no cuobjdump
(``cuobjdump --list-elf LIB`` shows the same set where a toolkit is installed).

Does not decide which architectures are required: the self-check does.

    python3 docker/cudaarch.py LIB.so [...]      # prints "sass: 70 75 80 ... | ptx: 90" per library
"""

from __future__ import annotations

import mmap
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import elf  # sibling module: this file also runs as a plain script

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX = 1
KIND_SASS = 2


@dataclass(frozen=True)
class Archs:
    """SM versions found in one library (empty sets: no fat binary, e.g. a CPU build)."""

    sass: frozenset[int] = field(default_factory=frozenset)
    ptx: frozenset[int] = field(default_factory=frozenset)

    def describe(self) -> str:
        def fmt(values: frozenset[int]) -> str:
            return " ".join(str(v) for v in sorted(values)) or "-"

        return f"sass: {fmt(self.sass)} | ptx: {fmt(self.ptx)}"


def parse_fatbin(data, start: int = 0, stop: int | None = None) -> Archs:
    """Walk every fat binary container in ``data[start:stop]`` (a ``.nv_fatbin`` section; bytes or an
    mmap, which is never copied) and collect entry kinds and SMs."""
    sass: set[int] = set()
    ptx: set[int] = set()
    pos = start
    limit = len(data) if stop is None else min(stop, len(data))
    while pos + 16 <= limit:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned; padding between them is skipped
            continue
        entry = pos + header_size
        end = min(entry + fat_size, limit)
        while entry + 32 <= end:
            kind, _ver, entry_header, payload = struct.unpack_from("<HHII", data, entry)
            sm = struct.unpack_from("<I", data, entry + 28)[0]
            if entry_header == 0:
                raise ValueError(f"malformed fat binary entry at offset {entry}")
            if kind == KIND_SASS:
                sass.add(sm)
            elif kind == KIND_PTX:
                ptx.add(sm)
            entry += entry_header + payload
        pos = max(end, pos + 8)
    return Archs(frozenset(sass), frozenset(ptx))


def library_archs(path: Path) -> Archs:
    """The architectures compiled into one shared object (empty when it has no ``.nv_fatbin``)."""
    where = elf.section(Path(path), ".nv_fatbin")
    if where is None:
        return Archs()
    offset, size = where
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return parse_fatbin(mapped, offset, offset + size)


def package_archs(package_dir: Path) -> dict[str, Archs]:
    """``{relative .so path: Archs}`` for every shared object under a package that carries GPU code."""
    found = {}
    for lib in sorted(Path(package_dir).rglob("*.so*")):
        if lib.is_file() and not lib.is_symlink():
            try:
                archs = library_archs(lib)
            except ValueError:
                continue
            if archs.sass or archs.ptx:
                found[lib.relative_to(package_dir).as_posix()] = archs
    return found


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: cudaarch.py LIB.so [...]", file=sys.stderr)
        return 2
    for name in argv:
        try:
            print(f"{name}: {library_archs(Path(name)).describe()}")
        except (OSError, ValueError) as exc:
            print(f"error: {name}: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
