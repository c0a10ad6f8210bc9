"""The operator's local files under runs/: fetched from the host or written here, always under a temporary
name first, then renamed, so a reader never sees half a file.

Owns how a failed local write is told: one line naming the file, and a full disk (ENOSPC, EDQUOT) as
"disk full", with what to do. ops.runstate writes its JSON files through `write_text`; the remote run
fetches the stage's summary through `fetch`.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ops.connection import Runner
from ops.errors import OpsError

FULL = (errno.ENOSPC, errno.EDQUOT)


def write_error(exc: OSError, path: Path) -> OpsError:
    """The one line for a failed write of the local file ``path``."""
    what = "disk full: " if exc.errno in FULL else ""
    return OpsError(
        f"{what}cannot write {path}: {exc.strerror or exc} (free space there, or choose another --runs-dir)"
    )


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all; OpsError naming it when that fails (the temp file is removed)."""
    tmp = _tmp(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(exc, path) from None


def fetch(runner: Runner, remote: str, local: Path) -> bool:
    """Copy the host's file ``remote`` to ``local`` (temp name, then rename): True when fetched, False when
    it could not be read on the host (a stage that wrote no summary). A local write that fails is no
    missing file: OpsError naming ``local`` ("disk full" for a full disk), and no temp file is left."""
    tmp = _tmp(local)
    try:
        runner.get(remote, tmp)
        os.replace(tmp, local)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in FULL or exc.filename in (str(tmp), str(local)):
            raise write_error(exc, local) from None
        return False
    return True
