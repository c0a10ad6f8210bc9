"""The stage containers on a host, typed: one `docker ps` and one parser for every question ops asks of them.

Owns which containers count (those carrying ops' run-id label), the fields ops reads of them (full id,
name, state, run id, stage, host output folder, host name; all from labels that ops.stage sets) and the
`docker ps` argv that lists them. The questions (is a stage running, does one write this output, which
run is this container) are asked of the list by the callers: ops.lock, ops.preflight, ops.remote_run.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from ops.connection import Runner
from ops.stage import LABEL_HOST, LABEL_OUT, LABEL_RUN, LABEL_STAGE


@dataclass(frozen=True)
class StageContainer:
    id: str  # full container id (what /proc's cgroup of a GPU holder names)
    name: str
    state: str  # docker's: running, exited, created, ...
    run_id: str
    stage: str
    output: str  # the host folder it writes
    host: str  # the hosts-file name of the host it was started for

    @property
    def running(self) -> bool:
        return self.state == "running"


FIELDS = (
    "{{.ID}}",
    "{{.Names}}",
    "{{.State}}",
    *(f'{{{{.Label "{label}"}}}}' for label in (LABEL_RUN, LABEL_STAGE, LABEL_OUT, LABEL_HOST)),
)


def inventory_argv(run_id: str | None = None) -> tuple[str, ...]:
    """`docker ps` of every stage container, running or not (only run ``run_id``'s when given)."""
    label = f"{LABEL_RUN}={run_id}" if run_id else LABEL_RUN
    return (
        "docker",
        "ps",
        "--all",
        "--no-trunc",
        "--filter",
        f"label={label}",
        "--format",
        "\t".join(FIELDS),
    )


def parse_inventory(text: str) -> list[StageContainer]:
    """The containers of `inventory_argv`'s output (lines of another shape are skipped)."""
    rows = (line.split("\t") for line in text.splitlines())
    return [StageContainer(*row) for row in rows if len(row) == len(FIELDS)]


def stage_containers(runner: Runner, run_id: str | None = None) -> list[StageContainer] | None:
    """The host's stage containers; None when docker could not answer (preflight reports docker itself)."""
    res = runner.run(shlex.join(inventory_argv(run_id)))
    return parse_inventory(res.stdout) if res.ok else None
