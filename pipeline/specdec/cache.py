"""Each engine's result kept under the key of everything that produced it, so that a run killed after some
engines, or a run asking one more k, starts only the engines it lacks (on a 1T target one engine start is an
18-minute load).

The key is the sha256 of the engine's settings, the method, the prompts' token ids, vLLM's version and the
target's and draft's files (name, size, mtime of each file in the folder): a retrained draft or a changed
target never meets an old result. A result is written whole (temp name, rename) once its engine exited
cleanly; a torn or unreadable one is ignored and measured again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from pipeline.ondisk.atomic import write_json
from pipeline.specdec.measure import Engine, Method


def folder_fingerprint(path: str | Path | None) -> list:
    """(name, size, mtime_ns) of each file directly in ``path`` (a model or draft folder), sorted."""
    if path is None:
        return []
    return sorted(
        (p.name, st.st_size, st.st_mtime_ns) for p in Path(path).iterdir() if p.is_file() and (st := p.stat())
    )


class ResultCache:
    """Results by key in one folder (beside the stage's output), for one engine's settings and prompts: what
    every method's key shares (the settings, the prompts, vLLM's version, the target's files) is read once."""

    def __init__(self, folder: Path, engine: Engine, prompts: list[list[int]]):
        import vllm

        self.folder = folder
        self._shared = {
            "engine": asdict(engine),
            "prompts": prompts,
            "vllm": vllm.__version__,
            "target_files": folder_fingerprint(engine.target),
        }

    def key(self, method: Method) -> str:
        blob = {**self._shared, "method": asdict(method), "draft_files": folder_fingerprint(method.draft)}
        return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()

    def _path(self, method: Method, digest: str) -> Path:
        return self.folder / f"{method.slug}-{digest[:20]}.json"

    def get(self, method: Method) -> dict | None:
        """The result kept under ``method``'s key, or None (none kept, or torn, or another key's)."""
        digest = self.key(method)
        try:
            result = json.loads(self._path(method, digest).read_text())
        except (OSError, ValueError):
            return None
        return result if isinstance(result, dict) and result.get("key") == digest else None

    def put(self, method: Method, result: dict) -> None:
        digest = self.key(method)
        self.folder.mkdir(parents=True, exist_ok=True)
        write_json(self._path(method, digest), {**result, "key": digest})
