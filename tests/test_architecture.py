"""The project's one architecture test: the two sides stay apart (ops/ never imports the ML stack, pipeline/
never the SSH/Docker stack), what they share (contract/) and the scripts ops runs alone on the host import
nothing but the standard library, and the shared facts are spelled once."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "ops": {"torch", "transformers", "vllm", "speculators", "safetensors", "pipeline", "numpy"},
    "pipeline": {"fabric", "paramiko", "invoke", "docker", "ops"},
}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_the_other_side(package):
    """No module of the package imports a forbidden top-level package (checked on the source, lazily imported
    too)."""
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"{package}/ has no modules"
    offenders = {
        f"{p.relative_to(REPO)}: {sorted(imported_roots(p) & FORBIDDEN[package])}"
        for p in files
        if imported_roots(p) & FORBIDDEN[package]
    }
    assert not offenders, offenders


def test_contract_is_standard_library_only():
    """contract/ imports only the standard library and itself, so both sides can import it without the other's
    stack."""
    files = sorted((REPO / "contract").rglob("*.py"))
    assert files, "contract/ has no modules"
    allowed = set(sys.stdlib_module_names) | {"contract", "__future__"}
    offenders = {
        f"{p.relative_to(REPO)}: {sorted(imported_roots(p) - allowed)}"
        for p in files
        if imported_roots(p) - allowed
    }
    assert not offenders, offenders


def test_host_side_scripts_are_standard_library_only():
    """ops/host/ runs alone on the host's python: standard library only (pynvml is sent with the agent)."""
    files = sorted((REPO / "ops" / "host").glob("*.py"))
    assert {p.name for p in files} >= {"agent.py", "lock.py"}
    for path in files:
        extra = imported_roots(path) - set(sys.stdlib_module_names) - {"__future__", "pynvml"}
        assert extra == set(), path.name


def test_shared_facts_are_spelled_once():
    """The facts contract/ owns are not restated on either side (the summary schema name, the image-digest
    variable, the shard rule's range)."""
    spelled = {
        '"eagle-ops.summary"': "contract/summary.py",
        '"EAGLE_OPS_IMAGE_DIGEST"': "contract/env.py",
        "range(rank, num_samples, world_size)": "contract/shards.py",
    }
    for needle, owner in spelled.items():
        found = sorted(
            str(p.relative_to(REPO))
            for package in ("ops", "pipeline", "contract")
            for p in (REPO / package).rglob("*.py")
            if needle in p.read_text()
        )
        assert found == [owner], (needle, found)


def module_imports(package: str) -> dict[str, set[str]]:
    """For each module of ``package``: the modules of the package it imports, function-local imports too."""
    root = REPO / package
    names = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
        for p in root.rglob("*.py")
    }
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in names:
                subs = {f"{node.module}.{a.name}" for a in node.names} & names.keys()
                found |= subs or {node.module}
        graph[name] = found - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles in ``graph`` (each found once, from its first module in sorted order)."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append(path[path.index(node) :] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for start in sorted(graph):
        visit(start, [])
    return found


@pytest.mark.parametrize("package", ["bench", "contract", "ops", "pipeline"])
def test_no_import_circles(package):
    """No module of the package imports, directly or through others, a module that imports it back
    (lazy function-local imports count: they hide a circle, they do not remove it)."""
    assert cycles(module_imports(package)) == []


# pipeline/'s two floors: the stages on top (each a module of pipeline/, its command with it) and the
# libraries below them, which any stage may use and which use no stage (docs/architecture.md)
STAGES = {"prepare", "weights", "verify", "preflight", "interop"}
LIBRARIES = {"ondisk", "model", "runtime", "backends", "extract", "train"}


def stage_imports(graph: dict[str, set[str]]) -> list[str]:
    """``library module -> stage module`` for each import of a top-floor stage by a library of pipeline/."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module.split(".")[1:2] and module.split(".")[1] in LIBRARIES
        for target in targets
        if target.split(".")[1:] and target.split(".")[1] in STAGES
    )


def test_pipeline_libraries_import_no_stage():
    """No library of pipeline/ (ondisk, model, runtime, backends, extract, train) imports a stage module
    (prepare, weights, verify, preflight, interop), lazily neither: what a library shares with a stage lives
    in a library, and a command that ends with another stage's check is composed in pipeline/cli.py."""
    graph = module_imports("pipeline")
    assert {name.split(".")[1] for name in graph if name.count(".") == 1} >= STAGES  # the stages still exist
    assert {name.split(".")[1] for name in graph if name.count(".") >= 2} >= LIBRARIES
    assert stage_imports(graph) == []


def test_the_floor_check_sees_an_upward_import():
    """The check above can fail: a library module importing a stage, directly or from the package, is
    named."""
    graph = {"pipeline.backends.vllm": {"pipeline.preflight"}, "pipeline.extract.cli": {"pipeline.verify"}}
    graph["pipeline.verify"] = {"pipeline.ondisk.formats"}  # a stage using a library is the rule
    assert stage_imports(graph) == [
        "pipeline.backends.vllm -> pipeline.preflight",
        "pipeline.extract.cli -> pipeline.verify",
    ]


def test_the_circle_finder_finds_circles():
    """A two-module and a three-module circle are found; a diamond is not a circle."""
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) == []


def test_the_checker_sees_imports(tmp_path):
    """The import scanner finds plain, dotted, from- and function-local imports (so the test above can
    fail)."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch.nn\nfrom fabric import Connection\ndef f():\n    import docker\n")
    assert imported_roots(probe) == {"torch", "fabric", "docker"}


# the round trips a phase of the extraction makes today, each a function of ondisk/formats.py that calls a
# helper of another ondisk module and goes on (bench/config_trip.py; docs/architecture.md)
PHASE_RETURNS = {"formats.py:read_prepared", "resume.py:prepare_output_dir", "formats.py:fold_checksums"}


def test_each_extraction_phase_visits_a_file_once(prepared_llama, tiny_llama, tmp_path):
    """The extraction's trip (issue #33 item 4): run's phases in their order (plan before the output
    directory before the loop before the bookkeeping), and within a phase no file is come back to once left,
    but for the three known ondisk round trips."""
    from bench.config_trip import phases, returns, trace

    visits = trace(prepared_llama, tiny_llama, tmp_path / "states")
    by_phase = phases(visits)
    order = list(by_phase)
    for earlier, later in [
        ("plan.py:plan_shard", "resume.py:prepare_output_dir"),
        ("resume.py:prepare_output_dir", "loop.py:run_loop"),
        ("loop.py:run_loop", "formats.py:fold_checksums"),
    ]:
        assert order.index(earlier) < order.index(later), order
    bouncing = {name for name, vs in by_phase.items() if returns(vs)}
    assert bouncing <= PHASE_RETURNS, bouncing - PHASE_RETURNS


def test_the_trip_counts_stays_and_returns():
    from bench.config_trip import Visit, returns, stays

    files = ["a.py", "a.py", "b.py", "a.py", "c.py", "b.py"]
    visits = [Visit(f, "f", "p", 2) for f in files]
    assert stays(visits) == [("a.py", 2), ("b.py", 1), ("a.py", 1), ("c.py", 1), ("b.py", 1)]
    assert returns(visits) == 2
