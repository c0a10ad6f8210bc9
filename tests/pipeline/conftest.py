"""Fixtures of the pipeline tests that damage a set: a private copy of the session's extract."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture
def states(tmp_path, extracted_llama):
    """A copy of the session's extract (24 files; ``copytree`` keeps each file's mtime), no summary.json."""
    d = tmp_path / "states"
    shutil.copytree(extracted_llama, d)
    (d / "summary.json").unlink(missing_ok=True)
    return d
