"""The local record of a run: runs/<host>/<run-id>/state.json, and atomic JSON writes.

Owns the state file's format: the run's identity, the step it is at (connect, lock, preflight,
stop-server, clean, start, follow, fetch, restore; attach adds attach), each step's start time, and how
it ended: status `running`, `done`, `detached` (the stage left running on purpose), `interrupted` (Ctrl-C
at `step`) or `failed` (at `step`, with the one-line error), plus what was left behind (container,
server). Rewritten atomically (temp name + rename) at every step, so a reader never sees half a file.
A step boundary is also where a deferred Ctrl-C takes effect and where the test pause seam sits. Also owns
where a run's folder lies: always inside --runs-dir (run_dir).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ops.errors import ConfigError
from ops.hosts import check_label
from ops.interrupts import Interrupts, pause_point
from ops.localfile import write_text
from ops.secret_env import redact

STEPS = ("connect", "lock", "preflight", "stop-server", "clean", "start", "follow", "fetch", "restore")


def run_dir(runs_root: Path, *labels: str) -> Path:
    """runs_root/<label>/...: each label (host name, run id) checked to be one safe folder name, and the
    result checked to lie inside runs_root, so that no name can place a run record elsewhere."""
    for label in labels:
        check_label(label, "run folder name", host=True)
    path = Path(runs_root).joinpath(*labels)
    try:
        root, where = Path(runs_root).resolve(), path.resolve()
    except (RuntimeError, OSError) as exc:  # Python 3.11's "Symlink loop from ..." (RuntimeError)
        raise ConfigError(
            f"--runs-dir {runs_root} cannot be resolved ({exc}); choose another --runs-dir"
        ) from None
    if root not in where.parents:
        raise ConfigError(f"run folder {path} would lie outside --runs-dir {runs_root}; choose another name")
    return path


def write_json(path: Path, data: dict) -> None:
    """Write a run file atomically (temp name, then rename); a failed write (a full disk) leaves neither
    the temp file nor half a file, and is one line naming the file."""
    # every run file passes the redactor: names of secrets may appear, values never (ops.secret_env)
    write_text(path, redact(json.dumps(data, indent=2, sort_keys=True, default=str)))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class RunState:
    def __init__(self, path: Path, interrupts: Interrupts | None, **facts) -> None:
        self.path = path
        self.interrupts = interrupts
        self.data: dict = {**facts, "status": "running", "step": None, "steps": [], "error": None}

    @classmethod
    def reopen(cls, path: Path, interrupts: Interrupts | None, **facts) -> "RunState":
        """The state of an existing run (attach), or a new one when this machine has none."""
        state = cls(path, interrupts, **facts)
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            return state
        if not isinstance(earlier, dict):
            return state  # not a run's state: this run starts a new record
        steps = earlier.get("steps")
        state.data.update(earlier)
        # this run's identity and a list of steps whatever the file held: the record stays this run's
        state.data.update(facts, status="running", error=None, steps=steps if isinstance(steps, list) else [])
        return state

    def step(self, name: str) -> None:
        """Enter a step: act on a deferred Ctrl-C first, record it, then the pause seam."""
        if self.interrupts is not None:
            self.interrupts.checkpoint()
        self.data["step"] = name
        self.data["steps"].append({"step": name, "at": _now()})
        self.save()
        pause_point(name, self.interrupts)

    def note(self, **facts) -> None:
        self.data.update(facts)
        self.save()

    def end(self, status: str, error: str | None = None, **facts) -> None:
        self.data.update(facts, status=status, error=error, ended_at=_now())
        self.save()

    def save(self) -> None:
        self.data["updated_at"] = _now()
        write_json(self.path, self.data)
