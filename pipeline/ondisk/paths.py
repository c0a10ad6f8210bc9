"""Paths a user hands a stage: the check every path option gets before a stage uses it.

Owns the one refusal every path option shares, a symlink loop on the way to the path (a link that points
back to itself, directly or through other links), said in one line naming the option and the path, before a
stage resolves, reads, locks or deletes anything; and ``resolved``, the ``Path.resolve`` the stages call on
a user's path, which gives that line instead of Python's ``RuntimeError: Symlink loop`` (3.11) wherever a
path was not checked at the command line (a config built in code). ``LoopCheckedPath`` is click's ``Path``
type with that check, for every path option of ``python -m pipeline``.

Does not decide whether a path must exist, be a file or a directory: each stage says that in its own words.
Imports click and the standard library only.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import click

from pipeline.errors import StageError


def symlink_loop(path: Path | str) -> bool:
    """True when the kernel cannot walk ``path`` for a symlink loop in it (ELOOP), as a component or at the
    end; a path that merely does not exist is not a loop."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    except ValueError:  # a NUL byte: not a path the kernel could walk at all, but not a loop either
        return False
    return False


def loop_error(path: Path | str, flag: str | None = None) -> StageError:
    what = f"{flag} {path}" if flag else str(path)
    return StageError(
        f"{what}: a symlink loop (a link that points back to itself, directly or through other links): "
        "fix or remove the link, or pass another path"
    )


def check_path(path: Path | str, flag: str | None = None) -> Path:
    """``path`` as a Path, refused in one line when a symlink loop lies on it."""
    if "\x00" in str(path):
        raise StageError(f"{flag + ' ' if flag else ''}{str(path)!r}: a path cannot hold a NUL byte")
    if symlink_loop(path):
        raise loop_error(path, flag)
    return Path(path)


def resolved(path: Path | str, flag: str | None = None) -> Path:
    """``Path(path).resolve()`` (links followed, a missing tail kept), a symlink loop refused in one line."""
    try:
        out = Path(path).resolve()
    except RuntimeError:  # Python 3.11's "Symlink loop from ..."
        raise loop_error(path, flag) from None
    except OSError as exc:  # newer Pythons may raise ELOOP itself
        if exc.errno == errno.ELOOP:
            raise loop_error(path, flag) from None
        raise
    if symlink_loop(out):
        raise loop_error(path, flag)
    return out


class LoopCheckedPath(click.Path):
    """click's ``Path`` (a ``pathlib.Path`` value) whose value is refused in the pipeline's one line when a
    symlink loop lies on it."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("path_type", Path)
        super().__init__(**kwargs)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        flag = param.opts[0] if param is not None and param.opts else None
        if value is not None and not isinstance(value, Path):
            check_path(os.fsdecode(value) if isinstance(value, bytes) else str(value), flag)
        elif isinstance(value, Path):
            check_path(value, flag)
        return super().convert(value, param, ctx)
