"""Check results: what a verification produced, as data. Only the CLI turns them into exit codes.

Owns the CheckResult record, the summary.json layout and the rich table that renders it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.ondisk.atomic import write_json

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str  # ok | warn | fail
    detail: str = ""
    file: str | None = None

    @property
    def failed(self) -> bool:
        return self.status == FAIL


def ok(name: str, detail: str = "", file: str | None = None) -> CheckResult:
    return CheckResult(name, OK, detail, file)


def fail(name: str, detail: str, file: str | None = None) -> CheckResult:
    return CheckResult(name, FAIL, detail, file)


def warn(name: str, detail: str, file: str | None = None) -> CheckResult:
    return CheckResult(name, WARN, detail, file)


def check(
    name: str, condition: bool, detail_ok: str, detail_fail: str, file: str | None = None
) -> CheckResult:
    return ok(name, detail_ok, file) if condition else fail(name, detail_fail, file)


@dataclass
class Summary:
    kind: str
    path: str
    checks: list[CheckResult] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(c.failed for c in self.checks)

    @property
    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if c.failed]

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "path": self.path,
            "ok": self.ok,
            "stats": self.stats,
            "failures": len(self.failures),
            "checks": [asdict(c) for c in self.checks],
        }

    def write(self, target: Path) -> None:
        write_json(target, self.to_json())

    def first_failure_line(self) -> str:
        first = self.failures[0]
        where = f"{first.file}: " if first.file else ""
        more = (
            f" (+{len(self.failures) - 1} more failed checks, see summary.json)"
            if len(self.failures) > 1
            else ""
        )
        return f"verify {self.path} failed: {where}{first.name}: {first.detail}{more}"


def render(summary: Summary, console=None, max_rows: int = 40) -> None:
    """Print the summary as a table: per-file checks that passed are folded into one row per check."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(stderr=False)
    table = Table(title=f"verify {summary.kind}: {summary.path}", show_lines=False)
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    colors = {OK: "green", WARN: "yellow", FAIL: "red"}
    folded: dict[str, int] = {}
    rows = []
    for c in summary.checks:
        if c.file and c.status == OK:
            folded[c.name] = folded.get(c.name, 0) + 1
            continue
        rows.append(c)
    for name, count in folded.items():
        table.add_row(name, f"[green]{OK}", f"{count} files")
    for c in rows[:max_rows]:
        table.add_row(c.name, f"[{colors[c.status]}]{c.status}", (f"{c.file}: " if c.file else "") + c.detail)
    if len(rows) > max_rows:
        table.add_row("...", "", f"{len(rows) - max_rows} more rows in summary.json")
    for k, v in summary.stats.items():
        if not isinstance(v, (dict, list)):
            table.add_row(k, "", str(v))
    console.print(table)
    console.print(
        f"[bold {'green' if summary.ok else 'red'}]{'OK' if summary.ok else 'FAILED'}[/] "
        f"({len(summary.failures)} failed checks)"
    )
