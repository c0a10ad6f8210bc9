"""The two sides stay apart: ops/ never imports the ML stack, pipeline/ never imports the SSH/Docker stack."""

from __future__ import annotations

import ast
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
    """No module of the package imports a forbidden top-level package (checked on the source, lazily imported too)."""
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"{package}/ has no modules"
    offenders = {f"{p.relative_to(REPO)}: {sorted(imported_roots(p) & FORBIDDEN[package])}"
                 for p in files if imported_roots(p) & FORBIDDEN[package]}
    assert not offenders, offenders


def test_the_checker_sees_imports(tmp_path):
    """The import scanner finds plain, dotted, from- and function-local imports (so the test above can fail)."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch.nn\nfrom fabric import Connection\ndef f():\n    import docker\n")
    assert imported_roots(probe) == {"torch", "fabric", "docker"}
