"""Provenance: every stage output says how it was made (commit, versions, patch set, image, argv, host,
times) under a versioned schema; and verify --model takes --trust-remote-code (a model of its own code)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from pipeline.ondisk import provenance
from tests.conftest import REPO, run_pipeline


def test_stage_outputs_record_how_they_were_made(prepared_llama, extracted_llama):
    """metadata.json, data_config.json and summary.json each carry a record of their own stage, with the
    checkout's commit and the exact argv; summary.json is under the versioned schema."""
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    meta = json.loads((prepared_llama / "metadata.json").read_text())["provenance"]
    config = json.loads((extracted_llama / "data_config.json").read_text())["provenance"]
    summary = json.loads((extracted_llama / "summary.json").read_text())
    assert summary["schema"] == "eagle-ops.summary" and summary["schema_version"] == 1
    for rec, stage in ((meta, "prepare"), (config, "extract"), (summary["provenance"], "verify")):
        assert rec["schema"] == provenance.SCHEMA and rec["version"] == 1 and rec["stage"] == stage
        assert rec["product"]["commit"] == head and rec["product"]["version"] == "0.1.0"
        assert rec["packages"]["torch"] and rec["packages"]["transformers"]
        assert rec["host"] == os.uname().nodename and rec["started"] <= rec["finished"]
    assert meta["argv"][1:3] == ["prepare", "--data"] and str(prepared_llama) in meta["argv"]
    assert config["argv"][1] == "extract" and summary["source_provenance"] == config


def test_image_digest_and_patch_marker_are_recorded(tmp_path, tiny_llama, monkeypatch):
    """The digest ops passes in EAGLE_OPS_IMAGE_DIGEST lands in metadata.json; the patch set's hash comes
    from the marker patches/apply.py writes next to the patched package, read through apply.py itself."""
    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
        )
        + "\n"
    )
    monkeypatch.setenv("EAGLE_OPS_IMAGE_DIGEST", "sha256:" + "ab" * 32)
    run_pipeline("prepare", "--data", data, "--model", tiny_llama, "--out", tmp_path / "p", check=True)
    rec = json.loads((tmp_path / "p" / "metadata.json").read_text())["provenance"]
    assert rec["image_digest"] == "sha256:" + "ab" * 32

    site = tmp_path / "site"
    (site / "speculators").mkdir(parents=True)
    (site / "speculators" / "__init__.py").write_text("")
    dist = (
        site / "speculators-0.9.0.dist-info"
    )  # apply.py finds a package by its distribution, as pip installed it
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: speculators\nVersion: 0.9.0\n")
    marker = site / "_eagle_ops_patches" / "speculators" / "state.json"
    marker.parent.mkdir(parents=True)
    applied = [{"name": "0001-fix.patch", "sha256": "1" * 64}]
    marker.write_text(json.dumps({"format": 1, "version": "0.9.0", "status": "applied", "patches": applied}))
    code = "import json; from pipeline.ondisk import provenance; print(json.dumps(provenance.patches()))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": f"{site}:{REPO}"},
    ).stdout
    got = json.loads(out)
    assert got["speculators"]["version"] == "0.9.0" and got["speculators"]["patches"] == ["0001-fix.patch"]
    assert (
        got["speculators"]["sha256"]
        == __import__("hashlib").sha256(json.dumps(applied, sort_keys=True).encode()).hexdigest()
    )
    assert got["sha256"] is not None
    applied[0]["sha256"] = "2" * 64
    marker.write_text(json.dumps({"format": 1, "version": "0.9.0", "status": "applied", "patches": applied}))
    again = json.loads(
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": f"{site}:{REPO}"},
        ).stdout
    )
    assert again["sha256"] != got["sha256"]  # another patch set, another hash


REMOTE_CODE = """
from transformers import LlamaConfig, LlamaForCausalLM


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
"""


def test_verify_model_takes_trust_remote_code(tmp_path, tiny_llama, extracted_llama):
    """A target whose config names its own code: verify --model without --trust-remote-code fails the
    recompute check with one reason (no traceback), and with it recomputes and passes."""
    model = tmp_path / "remote"
    shutil.copytree(tiny_llama, model)
    (model / "modeling_tiny_remote.py").write_text(REMOTE_CODE)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(
        model_type="tiny_remote",
        architectures=["TinyRemoteForCausalLM"],
        auto_map={
            "AutoConfig": "modeling_tiny_remote.TinyRemoteConfig",
            "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM",
        },
    )
    (model / "config.json").write_text(json.dumps(cfg))
    states = tmp_path / "states"
    shutil.copytree(extracted_llama, states)
    refused = run_pipeline("verify", states, "--model", model, "--recompute-samples", 2, input="")
    assert refused.returncode == 3 and "Traceback" not in refused.stderr, refused.stderr
    assert "recompute: cannot load --model" in refused.stderr and "pass --trust-remote-code" in refused.stderr
    ran = run_pipeline("verify", states, "--model", model, "--recompute-samples", 2, "--trust-remote-code")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    summary = json.loads((states / "summary.json").read_text())
    assert summary["stats"]["recompute"]["samples"] == 2
