"""What the operator asked of one stage command (remote-run, remote-extract, attach), as one value.

Owns the RunRequest, built once from the click options (`from_options`): the host list (one host, or
several for a multi-host run), the stage and its parsed arguments (ops.stageargs), the run id and the
flags that shape the run, and the refusals of combinations that cannot run (--detach with several hosts
or with --restore-server). ops.cli passes it whole to ops.remote_run, ops.fanout and attach. Pure: it
resolves no host and opens no connection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ops.errors import ConfigError
from ops.stageargs import StageArgs, parse


@dataclass(frozen=True)
class RunRequest:
    hosts: tuple[
        str, ...
    ]  # --host: one name (or user@host, local), or several, one shard each, in rank order
    hosts_file: str | None = None
    accept_new_host_key: bool = False
    stage: str = "extract"
    run_id: str | None = None  # None: a new one (STAGE-UTCSTAMP-XXXX), or a multi-host --resume's earlier one
    resume: bool = False
    restore_server: bool = False  # bring the server back at the end, also on failure and Ctrl-C
    runs_dir: Path = Path("runs")
    dry_run: bool = False
    detach: bool = False
    lock_wait: float = 0.0  # seconds to wait for another ops command's host lock (0: refuse at once)
    args: StageArgs = field(default_factory=StageArgs)  # the stage's arguments after `--`, parsed once

    @property
    def multi_host(self) -> bool:
        return len(self.hosts) > 1

    @property
    def host(self) -> str:
        """The one host of a one-host command (attach follows one host's stage container)."""
        if self.multi_host:
            raise ConfigError(f"--host {','.join(self.hosts)}: this command takes one host")
        return self.hosts[0]

    @classmethod
    def from_options(
        cls, *, host_spec: str, runs_dir: str | Path = "runs", extra: Iterable[str] = (), **options
    ) -> RunRequest:
        """From the click options of a stage command (`--host a,b` is a multi-host run)."""
        request = cls(
            hosts=tuple(split_hosts(host_spec)) if "," in host_spec else (host_spec,),
            runs_dir=Path(runs_dir),
            args=parse(extra),
            **options,
        )
        if request.detach and request.multi_host:
            raise ConfigError(
                "--detach runs one host; a multi-host run follows every host to merge the shards"
            )
        if request.detach and request.restore_server:
            raise ConfigError(
                "--restore-server with --detach would start the server beside the running stage; "
                "pass --restore-server to `attach` instead"
            )
        return request


def split_hosts(spec: str) -> list[str]:
    """`a,b,c` -> names; empty items and repeats are refused (the rank order must be unambiguous)."""
    names = [s.strip() for s in spec.split(",")]
    if any(not n for n in names):
        raise ConfigError(f"host list {spec!r} has an empty item; write HOST=a,b,c")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"host list {spec!r} names {', '.join(dupes)} twice; each host takes one shard")
    return names
