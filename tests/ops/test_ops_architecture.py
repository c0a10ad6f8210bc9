"""ops/ never imports the GPU stack or pipeline, and the host agent needs nothing but the standard library."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

OPS = Path(__file__).resolve().parents[2] / "ops"
FORBIDDEN = {"torch", "transformers", "vllm", "pipeline", "speculators", "safetensors"}


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_ops_does_not_import_the_gpu_stack_or_pipeline():
    """No module of ops/ imports torch, transformers, vllm, speculators, safetensors or pipeline."""
    bad = {p.name: sorted(imported(p) & FORBIDDEN) for p in OPS.glob("*.py") if imported(p) & FORBIDDEN}
    assert bad == {}


def test_host_side_scripts_are_standard_library_only():
    """hostagent.py and hostlock.py run alone on the host: only standard-library imports (pynvml is sent
    with the agent)."""
    for name in ("hostagent.py", "hostlock.py"):
        extra = imported(OPS / name) - set(sys.stdlib_module_names) - {"__future__", "pynvml"}
        assert extra == set(), name
