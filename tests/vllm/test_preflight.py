"""`pipeline preflight` on the real vLLM 0.16.0 / speculators 0.4.0.1: passes when patched, names every broken
check on an unpatched install, and stops a wrong layer count or vocab file before any model load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_pipeline
from tests.vllm.conftest import REPO, copy_model

pytestmark = pytest.mark.vllm

# checks that only a patched install passes (one per patch)
PATCH_CHECKS = [
    "vllm patches", "speculators patches",
    "vllm: DeepseekV3 SupportsEagle3", "vllm: KimiK25 SupportsEagle3", "vllm: eagle3 target list", "vllm: DeepseekV2 MHA rope on CPU",
    "speculators: trust_remote_code", "speculators: scheduler block size", "speculators: llama_4_scaling",
    "speculators: forced settings", "speculators: KV budget without accelerator",
    "speculators: results in input order", "speculators: dtype", "speculators: free finished prefills",
]
# checks of APIs that speculators 0.4.0.1 already handles on vLLM 0.16.0: they pass patched or not
UPSTREAM_CHECKS = [
    "vllm: get_kv_cache_config_from_groups", "vllm: Scheduler(block_size=)", "vllm: SchedulerConfig init vars",
    "vllm: two-phase execution", "vllm: collective_rpc(unique_reply_rank=)", "vllm: embed_input_ids",
    "speculators: all captured layers", "speculators: wrapper models",
]


def statuses(out: str) -> dict[str, str]:
    """check name -> ok/warn/fail, from preflight's output lines '[  0.12s] ok   name: detail'."""
    found = {}
    for line in out.splitlines():
        if line.startswith("[") and "s] " in line:
            status, rest = line.split("s] ", 1)[1].split(None, 1)
            found.setdefault(rest.split(": ", 1)[0], status)
            if status == "fail":
                found[rest.split(": ", 1)[0]] = "fail"
    return found


def preflight(*args, env=None) -> subprocess.CompletedProcess:
    return run_pipeline("preflight", *args, env=env, timeout=300)


def test_preflight_passes_on_the_patched_install(tiny_llama, prepared_llama, tmp_path):
    """Every check is ok (free disk included) on .venv-vllm with the patches applied; exit 0; --json written."""
    result = preflight("--model", tiny_llama, "--prepared", prepared_llama, "--out", tmp_path / "states",
                       "--json", tmp_path / "preflight.json")
    assert result.returncode == 0, result.stdout + result.stderr
    found = statuses(result.stdout)
    assert set(PATCH_CHECKS + UPSTREAM_CHECKS) <= set(found)
    assert all(v == "ok" for v in found.values()), found
    report = json.loads((tmp_path / "preflight.json").read_text())
    assert report["ok"] is True and len(report["checks"]) == len(found)


@pytest.fixture(scope="module")
def unpatched_overlay(tmp_path_factory) -> Path:
    """A PYTHONPATH overlay with vLLM and speculators as released (our patches reverted), never touching .venv-vllm.

    The overlay is a tree of symlinks to the installed packages (cp -rs); apply.py --revert then replaces only
    the patched files' links with the pristine files.
    """
    import vllm

    site = Path(vllm.__file__).resolve().parent.parent
    overlay = tmp_path_factory.mktemp("unpatched")
    names = ["vllm", "speculators", "_eagle_ops_patches"] + [p.name for p in site.glob("*.dist-info")
                                                             if p.name.startswith(("vllm", "speculators"))]
    for name in names:
        subprocess.run(["cp", "-rs", str(site / name), str(overlay / name)], check=True)
    result = subprocess.run([sys.executable, str(REPO / "patches" / "apply.py"), "--revert", "--site-packages", str(overlay)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    check = subprocess.run([sys.executable, str(REPO / "patches" / "apply.py"), "--check"], capture_output=True, text=True)
    assert check.returncode == 0, "the real .venv-vllm must still be patched"
    return overlay


def test_preflight_fails_on_an_unpatched_install_naming_each_broken_check(tiny_llama, unpatched_overlay):
    """With released vLLM/speculators first on sys.path, every patch-dependent check fails by name; exit 3."""
    env = {**os.environ, "PYTHONPATH": f"{unpatched_overlay}{os.pathsep}{REPO}", "COLUMNS": "200"}
    result = preflight("--model", tiny_llama, env=env)
    assert result.returncode == 3, result.stdout + result.stderr
    found = statuses(result.stdout)
    assert {n for n in PATCH_CHECKS if found.get(n) != "fail"} == set(), found
    assert {n for n in UPSTREAM_CHECKS if found.get(n) != "ok"} == set(), found
    assert found["layer count"] == "ok" and found["tokenizer"] == "ok"
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("error: preflight:") and "speculators: results in input order" in summary


def test_wrong_layer_count_fails_with_a_clear_message(tiny_llama, tmp_path):
    """config.json claiming 9 layers for an 8-layer checkpoint fails 'layer count', naming both numbers."""
    model = copy_model(tiny_llama, tmp_path / "model", num_hidden_layers=9)
    result = preflight("--model", model)
    assert result.returncode == 3
    line = next(ln for ln in result.stdout.splitlines() if "layer count" in ln)
    assert "fail" in line and "config.json says 9 decoder layers" in line and "layers 0..7 (8)" in line
    assert "layer count" in result.stderr


def test_wrong_vocab_file_fails_with_a_clear_message(tiny_llama, prepared_llama, tmp_path):
    """A t2d.npy of the wrong length (another model's vocab) fails 'vocab files' naming both sizes."""
    prepared = tmp_path / "prepared"
    shutil.copytree(prepared_llama, prepared)
    t2d = np.load(prepared / "t2d.npy")
    np.save(prepared / "t2d.npy", np.concatenate([t2d, np.zeros(976, dtype=bool)]))
    result = preflight("--model", tiny_llama, "--prepared", prepared)
    assert result.returncode == 3
    line = next(ln for ln in result.stdout.splitlines() if "vocab files" in ln)
    assert "fail" in line and "t2d.npy has 2000 entries, the model's vocab_size is 1024" in line


def test_data_prepared_for_another_vocab_fails(tiny_llama, prepared_llama, tmp_path):
    """A model whose vocab_size differs from the prepared data's fails 'prepared data' and 'embedding'."""
    model = copy_model(tiny_llama, tmp_path / "model", vocab_size=2048)
    result = preflight("--model", model, "--prepared", prepared_llama)
    found = statuses(result.stdout)
    assert result.returncode == 3
    assert found["prepared data"] == "fail" and found["embedding"] == "fail" and found["vocab files"] == "fail"


def test_bad_layer_ids_and_tensor_parallel_fail(tiny_llama):
    """Layer ids not ending at the last layer, and a TP size that does not divide the heads, each fail by name."""
    result = preflight("--model", tiny_llama, "--layer-ids", "1,2,3", "--tensor-parallel-size", "3")
    found = statuses(result.stdout)
    assert result.returncode == 3
    assert found["layer ids"] == "fail" and found["tensor parallel"] == "fail"
    assert "num_attention_heads 4 is not divisible by tensor parallel size 3" in result.stdout


def test_stray_pt_file_in_output_dir_fails(tiny_llama, tmp_path):
    """A token_freq.pt inside the hidden-states dir fails: speculators would load it as a sample."""
    out = tmp_path / "states"
    out.mkdir()
    (out / "token_freq.pt").write_bytes(b"x")
    result = preflight("--model", tiny_llama, "--out", out, "--backend", "hf")
    assert result.returncode == 3 and statuses(result.stdout)["output dir"] == "fail"


def test_missing_chat_template_fails(tiny_llama, tmp_path):
    """A tokenizer without a chat template fails 'chat template'."""
    model = copy_model(tiny_llama, tmp_path / "model")
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    result = preflight("--model", model, "--backend", "hf")
    assert result.returncode == 3 and statuses(result.stdout)["chat template"] == "fail"


def test_preflight_never_reads_weights(tiny_llama, tmp_path):
    """Preflight passes on a checkpoint whose tensor data is cut off: only safetensors headers are read."""
    model = copy_model(tiny_llama, tmp_path / "model")
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    weights.write_bytes(data[: 8 + header_len + 16])
    result = preflight("--model", model, "--backend", "hf")
    assert result.returncode == 0, result.stdout + result.stderr
