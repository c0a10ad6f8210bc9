"""The config's trip through an extraction, measured (issue #33 item 4): the calls ``extract/stage.py:run``
makes into pipeline/'s modules (its phases), and the calls each phase makes in turn, in call order, grouped
into stays (consecutive calls into one file). Five calls are handed the ``ExtractConfig`` itself: ``run``
unpacks it and hands on what it derived, so the trip is the run's own calls, not the object's.

    python -m bench.config_trip --prepared DIR --model DIR [--workdir DIR]
    cd TREE && PYTHONPATH=TREE:REPO python -m bench.config_trip ...   # another commit's pipeline/

A stay that comes back to a file the trip had already left is a return; the layout goal is none within a
phase (tests/test_architecture.py allows the three ondisk round trips left). Runs the extraction in this
process on the CPU (``sys.setprofile`` on its thread), so a tiny model is the right input: `make demo`'s, or
the tests' (tests/test_architecture.py runs it on one).
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click


def stage_entry():
    """``run`` and ``ExtractConfig`` of the pipeline package on the path: extract/stage.py and
    extract/config.py, or, in a tree from before issue #33's layout step (a baseline), extract.py."""
    try:
        from pipeline.extract.config import ExtractConfig
        from pipeline.extract.stage import run
    except ImportError:
        from pipeline.extract import ExtractConfig, run
    return run, ExtractConfig


@dataclass(frozen=True)
class Visit:
    file: str  # relative to the repository
    function: str
    phase: str  # "file:function" of the call run made on the way here
    depth: int  # calls between run and this one, plus one: 1 for run's own calls


def below(frame, run_code) -> tuple[str, int] | None:
    """For a call under ``run``: the call run made on the way to it ("file:function") and its depth (pure
    but for reading the frames); None outside run."""
    chain = []
    while frame is not None and frame.f_code is not run_code:
        chain.append(frame)
        frame = frame.f_back
    if frame is None or not chain:
        return None
    top = chain[-1].f_code
    return f"{Path(top.co_filename).name}:{top.co_name}", len(chain)


def trace(prepared: Path, model: Path, out: Path) -> list[Visit]:
    """Run the extraction and return the calls into pipeline/ made under ``run`` on this thread, at depth 1
    and 2 (run's own, and each phase's)."""
    import pipeline

    run, ExtractConfig = stage_entry()
    root = Path(pipeline.__file__).resolve().parent
    visits: list[Visit] = []

    def hook(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(f"{root}/"):
            return
        where = below(frame, run.__code__)
        if where is not None and where[1] <= 2:
            rel = "pipeline/" + frame.f_code.co_filename[len(str(root)) + 1 :]
            visits.append(Visit(rel, frame.f_code.co_name, *where))

    cfg = ExtractConfig(prepared=prepared, model=model, out=out, device="cpu", verify=False, progress=False)
    sys.setprofile(hook)
    try:
        run(cfg)
    finally:
        sys.setprofile(None)
    return visits


def stays(visits: list[Visit]) -> list[tuple[str, int]]:
    """Consecutive visits to one file, as (file, calls) (pure)."""
    out: list[tuple[str, int]] = []
    for v in visits:
        if out and out[-1][0] == v.file:
            out[-1] = (v.file, out[-1][1] + 1)
        else:
            out.append((v.file, 1))
    return out


def returns(visits: list[Visit]) -> int:
    """Stays in a file the trip had already left (pure)."""
    seen: set[str] = set()
    count = 0
    for file, _ in stays(visits):
        count += file in seen
        seen.add(file)
    return count


def phases(visits: list[Visit]) -> dict[str, list[Visit]]:
    """Each phase's own calls (depth 2), phases in order of their first call (pure)."""
    out: dict[str, list[Visit]] = {}
    for v in visits:
        out.setdefault(v.phase, [])
        if v.depth == 2:
            out[v.phase].append(v)
    return out


def report(visits: list[Visit]) -> str:
    """The trip as text: run's own calls, then each phase's (pure)."""
    top = [v for v in visits if v.depth == 1]
    files = len({v.file for v in top})
    lines = [
        f"run's calls into pipeline/: {len(top)} calls, {len(stays(top))} stays in {files} files, "
        f"{returns(top)} returns to a file already left",
        "",
        "| phase (run's call) | its calls | stays | returns | files, in order (calls) |",
        "|---|---:|---:|---:|---|",
    ]
    for name, vs in phases(visits).items():
        order = " -> ".join(f"{f.removeprefix('pipeline/')} ({n})" for f, n in stays(vs)) or "-"
        lines.append(f"| {name} | {len(vs)} | {len(stays(vs))} | {returns(vs)} | {order} |")
    return "\n".join(lines)


@click.command()
@click.option("--prepared", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None)
def main(prepared: Path, model: Path, workdir: Path | None) -> None:
    """Trace an extraction's config and print its stays per phase."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        click.echo(report(trace(prepared, model, Path(tmp) / "states")))


if __name__ == "__main__":
    main()
