"""Reading the two things the self-check needs from a shared object's ELF headers: where a named section
lies in the file, and which shared libraries it needs (DT_NEEDED).

Owns ELF parsing for docker/ (64-bit little-endian only, the x86_64 and aarch64 case); cudaarch.py reads
the ``.nv_fatbin`` section through it. Does not load or run the library; standard library only.
"""

from __future__ import annotations

import struct
from pathlib import Path

ELF_MAGIC = b"\x7fELF"
DT_NEEDED = 1


def _headers(path: Path) -> tuple[list[tuple[int, ...]], bytes]:
    """Section headers (name index, type, flags, addr, offset, size) and the section-name string table."""
    with open(path, "rb") as fh:
        ident = fh.read(64)
        if ident[:4] != ELF_MAGIC:
            raise ValueError(f"{path} is not an ELF file")
        if ident[4] != 2 or ident[5] != 1:
            raise ValueError(f"{path}: only 64-bit little-endian ELF is supported")
        shoff = struct.unpack_from("<Q", ident, 0x28)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", ident, 0x3A)
        if shoff == 0 or shnum == 0:
            return [], b""
        fh.seek(shoff)
        table = fh.read(shentsize * shnum)
        headers = [struct.unpack_from("<IIQQQQ", table, i * shentsize) for i in range(shnum)]
        fh.seek(headers[shstrndx][4])
        names = fh.read(headers[shstrndx][5])
    return headers, names


def section(path: Path, wanted: str) -> tuple[int, int] | None:
    """(file offset, size) of the named section, or None when the file has no such section."""
    headers, names = _headers(Path(path))
    for name_idx, _type, _flags, _addr, offset, size in headers:
        end = names.find(b"\0", name_idx)
        if names[name_idx:end].decode(errors="replace") == wanted:
            return offset, size
    return None


def needed(path: Path) -> list[str]:
    """The sonames a shared object needs (its DT_NEEDED entries), in order."""
    dynamic, dynstr = section(path, ".dynamic"), section(path, ".dynstr")
    if dynamic is None or dynstr is None:
        return []
    with open(path, "rb") as fh:
        fh.seek(dynamic[0])
        entries = fh.read(dynamic[1])
        fh.seek(dynstr[0])
        strings = fh.read(dynstr[1])
    out = []
    for pos in range(0, len(entries) - 15, 16):
        tag, value = struct.unpack_from("<qQ", entries, pos)
        if tag == 0:  # DT_NULL ends the table
            break
        if tag == DT_NEEDED:
            out.append(strings[value : strings.find(b"\0", value)].decode())
    return out
