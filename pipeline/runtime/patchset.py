"""What patches/apply.py says about the installed packages: the one way the pipeline asks about patch sets.

patches/apply.py owns the patch sets, their markers and ``--check``; this module loads it as a module (it
imports nothing of the project, so it also runs on a bare Python) and asks it the two questions the
pipeline has: is the set for a package applied and current (preflight), and what does the package's marker
record (provenance). Never patches anything.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

PATCHES_DIR = Path(__file__).resolve().parents[2] / "patches"  # pipeline/runtime/ -> the checkout


@functools.cache
def apply_script() -> ModuleType:
    """patches/apply.py as a module."""
    path = PATCHES_DIR / "apply.py"
    spec = importlib.util.spec_from_file_location("_eagle_ops_apply", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}: the checkout or image lacks patches/apply.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def status(package: str) -> tuple[bool, str]:
    """(current, what apply.py --check says) for the installed ``package``; raises apply.py's PatchError
    when it is not installed, has no patch set for its version, or the installed code is unknown."""
    apply = apply_script()
    inst = apply.find_installed(package, None)
    return apply.status(inst, apply.load_patches(PATCHES_DIR, inst))


def marker(package: str) -> dict | None:
    """The marker apply.py wrote into the installed ``package``'s site-packages (None: never patched);
    raises apply.py's PatchError when the package is not installed or the marker is unreadable."""
    apply = apply_script()
    return apply.read_state(apply.find_installed(package, None))


def is_installed(package: str) -> bool:
    try:
        apply_script().find_installed(package, None)
    except Exception:  # noqa: BLE001 - PatchError: not installed, or several versions
        return False
    return True
