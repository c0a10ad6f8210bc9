#!/usr/bin/env python3
"""The image's self-check: does this Python environment hold exactly the lock, the patch set, and GPU code
for the architectures we serve on?

Runs as the last build step of the Dockerfile (a failing check fails the build, so no image exists
that has not passed it) and again from ``make image-check`` against the build host's current lock and
patch tree. Checks, each returning a CheckResult:

- lock:      every pin of the lock file installed at exactly its version (nothing missing, nothing moved);
             distributions the lock does not name are listed as a warning.
- hashes:    the lock file and the patch tree hash to the values the OCI labels claim.
- patches:   ``patches/apply.py --check`` (the one apply script) reports every patch applied and current.
- imports:   the modules the stages need import (torch, vllm, speculators, transformers, ...).
- torch:     torch was compiled for every required SM (e.g. 90 for H200, 120 for RTX PRO 6000).
- kernels:   named compiled libraries (vLLM's ``_C.abi3.so``...) carry SASS for every required SM.
- libs:      every shared library a package's compiled modules need is in the image (the NVIDIA driver's
             libraries excepted: the container toolkit mounts them at run time). vLLM's ``import vllm``
             only warns when ``vllm._C`` fails to load, so a missing library would otherwise surface at
             the first kernel call.

Does not start a GPU, load a model, or change anything; the only file it writes is the ``--json`` report.
Standard library plus whatever it is asked to import.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cudaarch  # sibling modules: this file also runs as a plain script
import elf
import imageinfo

# Provided by the NVIDIA driver on the GPU host (mounted into the container at run time), never in the image.
DRIVER_LIBS = frozenset({"libcuda.so.1", "libnvidia-ml.so.1"})
SYSTEM_LIB_DIRS = (
    "/lib",
    "/lib64",
    "/usr/lib",
    "/usr/lib64",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/local/lib",
    "/usr/local/cuda/lib64",
)


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str


def ok(name: str, detail: str) -> CheckResult:
    return CheckResult(name, "ok", detail)


def warn(name: str, detail: str) -> CheckResult:
    return CheckResult(name, "warn", detail)


def fail(name: str, detail: str) -> CheckResult:
    return CheckResult(name, "fail", detail)


# ------------------------------------------------------------------ pure checks (tested with plain data)


def installed_distributions() -> dict[str, str]:
    """``{normalized name: version}`` of what this interpreter can import from."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name")
        if name:
            found.setdefault(imageinfo.normalize(name), dist.version)
    return found


def check_lock(
    installed: dict[str, str],
    pins: dict[str, str],
    may_differ: frozenset[str] = frozenset(),
    tolerated_extras: frozenset[str] = frozenset({"pip"}),
) -> list[CheckResult]:
    """Compare installed distributions with the lock's pins (names already normalized)."""
    results = []
    missing = sorted(name for name in pins if name not in installed)
    moved = sorted(name for name in pins if name in installed and installed[name] != pins[name])
    hard_moved = [n for n in moved if n not in may_differ]
    if missing or hard_moved:
        parts = []
        if missing:
            parts.append("missing: " + ", ".join(f"{n}=={pins[n]}" for n in missing))
        if hard_moved:
            parts.append("moved: " + ", ".join(f"{n} {installed[n]} (lock {pins[n]})" for n in hard_moved))
        results.append(fail("lock", "; ".join(parts) + ": rebuild the image from this lock"))
    else:
        results.append(ok("lock", f"{len(pins)} pins installed at exactly the locked versions"))
    for name in sorted(set(moved) & may_differ):
        results.append(
            warn("lock", f"{name} {installed[name]} replaces the lock's {pins[name]} (build argument)")
        )
    extras = sorted(set(installed) - set(pins) - tolerated_extras)
    if extras:
        results.append(
            warn("lock", "installed but not in the lock: " + ", ".join(f"{n} {installed[n]}" for n in extras))
        )
    return results


def check_hash(name: str, expected: str | None, actual: str) -> CheckResult:
    if not expected:
        return warn(name, f"{actual} (no expected value given)")
    if expected != actual:
        return fail(name, f"label/argument says {expected}, the files hash to {actual}")
    return ok(name, actual)


def parse_arch_flags(flags: str) -> frozenset[int]:
    """SM numbers from torch's arch flags, e.g. 'sm_80 sm_90 sm_90a sm_120 compute_120' -> {80, 90, 120}."""
    sms = set()
    for token in flags.replace(";", " ").split():
        if token.startswith("sm_"):
            digits = "".join(ch for ch in token[3:] if ch.isdigit())
            if digits:
                sms.add(int(digits))
    return frozenset(sms)


def check_archs(name: str, what: str, have: frozenset[int], required: frozenset[int]) -> CheckResult:
    lacking = sorted(required - have)
    have_txt = " ".join(str(v) for v in sorted(have)) or "none"
    if lacking:
        return fail(name, f"{what} lacks sm_{', sm_'.join(map(str, lacking))} (has: {have_txt})")
    return ok(name, f"{what}: sm {have_txt}")


# ------------------------------------------------------------------ checks that look at the environment


def check_patches(apply_script: Path, patches: Path) -> CheckResult:
    proc = subprocess.run(
        [sys.executable, str(apply_script), "--check", "--patches", str(patches)],
        capture_output=True,
        text=True,
        check=False,  # its exit code is the finding
    )
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    detail = " | ".join(lines) or f"apply.py printed nothing (exit {proc.returncode})"
    return ok("patches", detail) if proc.returncode == 0 else fail("patches", detail)


def check_imports(modules: list[str]) -> list[CheckResult]:
    """Import each module; failing only for want of the driver's libraries (no GPU at build time) warns."""
    results = []
    for module in modules:
        try:
            mod = importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001  (any failure to import is the finding)
            text = f"import {module}: {type(exc).__name__}: {exc}"
            if any(lib in str(exc) for lib in DRIVER_LIBS):
                results.append(warn("imports", text + " (the NVIDIA driver provides it on the GPU host)"))
            else:
                results.append(fail("imports", text))
            continue
        version = getattr(mod, "__version__", None)
        results.append(ok("imports", f"{module} {version}" if version else module))
    return results


def check_torch(required: frozenset[int]) -> CheckResult:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001  (any failure to import is the finding)
        return fail("torch", f"import torch: {exc}")
    getter = getattr(torch._C, "_cuda_getArchFlags", None)
    if getter is None or not torch.version.cuda:
        return fail("torch", f"torch {torch.__version__} is not a CUDA build (no arch list)")
    return check_archs(
        "torch",
        f"torch {torch.__version__} (CUDA {torch.version.cuda})",
        parse_arch_flags(getter() or ""),
        required,
    )


def check_kernels(spec: str, required: frozenset[int]) -> list[CheckResult]:
    """spec: 'package:lib1,lib2' with library paths relative to the package folder."""
    package, _, libs = spec.partition(":")
    try:
        spec_obj = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec_obj = None
    if spec_obj is None or not spec_obj.submodule_search_locations:
        return [fail("kernels", f"package {package} not found")]
    root = Path(next(iter(spec_obj.submodule_search_locations)))
    results = []
    for rel in [lib for lib in libs.split(",") if lib]:
        path = root / rel
        if not path.is_file():
            results.append(fail("kernels", f"{package}/{rel} not found"))
            continue
        archs = cudaarch.library_archs(path)
        results.append(check_archs("kernels", f"{package}/{rel} SASS", archs.sass, required))
    return results


def available_sonames(site: Path) -> set[str]:
    """Shared-library file names the dynamic loader can find here: system dirs, ldconfig's cache, and
    every library shipped inside site-packages (torch/lib, nvidia/*/lib: python loads them first)."""
    names: set[str] = set()
    dirs = [Path(d) for d in SYSTEM_LIB_DIRS]
    dirs += [Path(d) for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for folder in dirs:
        if folder.is_dir():
            names.update(p.name for p in folder.iterdir())
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        cache = ""
    for line in cache.splitlines()[1:]:  # "libnuma.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libnuma.so.1"
        name, _, target = line.strip().partition(" => ")
        if target and Path(target).exists():  # the cache can be stale
            names.add(name.split()[0])
    names.update(p.name for p in site.rglob("*.so*"))
    return names


def missing_libraries(libs: list[Path], available: set[str]) -> dict[str, list[str]]:
    """``{library: [needed sonames not available]}`` for the libraries that lack something (pure)."""
    missing = {}
    for lib in libs:
        absent = [name for name in elf.needed(lib) if name not in available and name not in DRIVER_LIBS]
        if absent:
            missing[lib.name] = absent
    return missing


def check_libs(package: str) -> CheckResult:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return fail("libs", f"package {package} not found")
    root = Path(next(iter(spec.submodule_search_locations)))
    libs = sorted(p for p in root.rglob("*.so") if p.is_file())
    if not libs:
        return fail("libs", f"{package} has no compiled modules")
    missing = missing_libraries(libs, available_sonames(root.parent))
    if missing:
        text = "; ".join(f"{lib} needs {', '.join(names)}" for lib, names in sorted(missing.items()))
        return fail("libs", f"{package}: {text}: not in the image (add the OS package to the base)")
    driver = sorted({n for lib in libs for n in elf.needed(lib)} & DRIVER_LIBS)
    extra = f" (from the driver at run time: {', '.join(driver)})" if driver else ""
    return ok("libs", f"{package}: {len(libs)} compiled modules, every needed library present{extra}")


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> list[CheckResult]:
    results: list[CheckResult] = []
    if args.lock:
        pins = imageinfo.lock_pins(args.lock)
        results += check_lock(
            installed_distributions(), pins, frozenset(map(imageinfo.normalize, args.may_differ))
        )
        results.append(check_hash("lock-sha256", args.expect_lock_sha256, imageinfo.file_sha256(args.lock)))
    if args.patches:
        results.append(
            check_hash("patches-sha256", args.expect_patches_sha256, imageinfo.patches_sha256(args.patches))
        )
        results.append(check_patches(args.patches / "apply.py", args.patches))
    results += check_imports(args.imports)
    required = frozenset(args.require_arch)
    if required and args.torch_archs:
        results.append(check_torch(required))
    for spec in args.kernels:
        results += check_kernels(spec, required)
    results += [check_libs(package) for package in args.libs_of]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lock", type=Path, help="lock file the environment must match exactly")
    parser.add_argument("--patches", type=Path, help="patch tree (holding apply.py) that must be applied")
    parser.add_argument("--expect-lock-sha256", help="the lock hash the image's label claims")
    parser.add_argument("--expect-patches-sha256", help="the patch-set hash the image's label claims")
    parser.add_argument(
        "--may-differ",
        action="append",
        default=[],
        metavar="DIST",
        help="a distribution allowed to differ from the lock (a swapped-in nightly wheel)",
    )
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE")
    parser.add_argument(
        "--require-arch",
        action="append",
        type=int,
        default=[],
        metavar="SM",
        help="an SM the GPU code must include (90 = sm_90, 120 = sm_120); repeatable",
    )
    parser.add_argument(
        "--no-torch-archs",
        dest="torch_archs",
        action="store_false",
        help="skip torch's compiled arch list (a CPU torch)",
    )
    parser.add_argument(
        "--kernels",
        action="append",
        default=[],
        metavar="PKG:LIB[,LIB]",
        help="compiled libraries that must carry SASS for every required SM",
    )
    parser.add_argument(
        "--libs-of",
        action="append",
        default=[],
        metavar="PKG",
        help="every shared library PKG's compiled modules need must be in the image",
    )
    parser.add_argument("--json", type=Path, help="also write the results here (atomically)")
    args = parser.parse_args(argv)
    try:
        results = run(args)
    except (OSError, ValueError) as exc:
        print(f"[selfcheck] error: {exc}", file=sys.stderr)
        return 2
    for res in results:
        print(f"[selfcheck] {res.status:<4} {res.name:<14} {res.detail}")
    failed = [r for r in results if r.status == "fail"]
    if args.json:
        write_json(args.json, {"ok": not failed, "results": [asdict(r) for r in results]})
    print(
        f"[selfcheck] {'FAILED' if failed else 'passed'}: {len(results)} checks, {len(failed)} failed, "
        f"{sum(r.status == 'warn' for r in results)} warnings"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
