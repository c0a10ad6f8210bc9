"""Where ``regenerate`` keeps what it finished: the journal a killed run continues from, and the final files.

Owns the output directory's files:
- ``request.json``: what the rows were asked with (the input's sha256, turns, sampling, the model name);
  a run into a directory whose request differs is refused, since its rows would mix two recipes;
- ``journal.jsonl``: one line per finished row (``{"id", "row"}`` or ``{"id", "rejected"}``), appended with
  one write and fsynced, so a kill leaves at most a torn last line, which the next run drops;
- at the end, ``conversations.jsonl`` (kept rows, in input order), ``rejected.jsonl`` and ``summary.json``,
  each written under a temporary name and renamed; ``summary.json`` is written last and means "complete".
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from pipeline.errors import StageError
from pipeline.ondisk.atomic import atomic_path, write_json

REQUEST, JOURNAL = "request.json", "journal.jsonl"
CONVERSATIONS, REJECTED, SUMMARY = "conversations.jsonl", "rejected.jsonl", "summary.json"
OURS = (REQUEST, JOURNAL, CONVERSATIONS, REJECTED, SUMMARY, "server.log")


def refuse(out: Path, request: dict, *, overwrite: bool) -> None:
    """The output directory's policy, reading only (``--check`` runs it alone): refused in one line when it
    is not a directory, holds files this stage did not write, or, without ``--overwrite``, holds a finished
    run or a run asked with other settings than ``request``. A missing directory is a new run."""
    if not out.exists():
        return
    if not out.is_dir():
        raise StageError(f"--out {out} exists and is not a directory: choose another --out")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in OURS and not p.name.startswith("."))
    if foreign:
        raise StageError(
            f"--out {out} holds files regenerate did not write ({', '.join(foreign[:3])}): "
            "choose an empty or new directory"
        )
    if overwrite:
        return
    if (out / SUMMARY).exists():
        raise StageError(f"--out {out} already holds a finished regenerate run: pass --overwrite to redo it")
    path = out / REQUEST
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = None
        differ = sorted(k for k in request if not isinstance(old, dict) or old.get(k) != request[k])
        if differ:
            raise StageError(
                f"--out {out} holds a run asked with other settings ({', '.join(differ)}): pass the same "
                "options to continue it, or --overwrite to start over"
            )


class Journal:
    """The finished rows of one output directory."""

    def __init__(self, out: Path, request: dict, *, overwrite: bool):
        self.out = out
        self.done: dict[str, dict] = {}
        out.mkdir(parents=True, exist_ok=True)
        refuse(out, request, overwrite=overwrite)
        if overwrite:
            for name in OURS:
                with contextlib.suppress(FileNotFoundError):
                    (out / name).unlink()
        if not (out / REQUEST).exists():
            write_json(out / REQUEST, request)
        self._read()
        self._fd = os.open(out / JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _read(self) -> None:
        path = self.out / JOURNAL
        if not path.exists():
            return
        raw = path.read_bytes()
        good = 0
        for line in raw.splitlines(keepends=True):
            try:
                entry = json.loads(line) if line.endswith(b"\n") else None
            except ValueError:
                entry = None
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                break  # a torn or foreign line: the kill came here; what follows is not trusted
            self.done[entry["id"]] = entry
            good += len(line)
        if good < len(raw):
            os.truncate(path, good)

    def add(self, row_id: str, *, row: dict | None = None, rejected: dict | None = None) -> None:
        entry = {"id": row_id, "row": row} if row is not None else {"id": row_id, "rejected": rejected}
        self.done[row_id] = entry
        os.write(self._fd, (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8"))
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)

    def finish(self, order: list[str], summary: dict) -> None:
        """The final files, from the journal, in input order; summary.json last."""
        with atomic_path(self.out / CONVERSATIONS) as tmp, open(tmp, "w", encoding="utf-8") as fh:
            for row_id in order:
                if "row" in self.done[row_id]:
                    fh.write(json.dumps(self.done[row_id]["row"], ensure_ascii=False) + "\n")
        with atomic_path(self.out / REJECTED) as tmp, open(tmp, "w", encoding="utf-8") as fh:
            for row_id in order:
                if "rejected" in self.done[row_id]:
                    fh.write(
                        json.dumps({"id": row_id, **self.done[row_id]["rejected"]}, ensure_ascii=False) + "\n"
                    )
        write_json(self.out / SUMMARY, summary)
