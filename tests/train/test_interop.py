"""export-speculators / import-speculators on real stage outputs: speculators 0.9's own `speculators train`
trains from what we export, the round trip is bit-identical, and bad inputs get one line and exit 2."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline import interop

from pipeline.ondisk import formats
from tests.conftest import run_pipeline

CPU_SHIM = Path(__file__).resolve().parent / "speculators_cpu"
DRAFT_VOCAB = 64


@pytest.fixture(scope="module")
def ours(tmp_path_factory, tiny_llama, conversations) -> Path:
    """Our prepare -> extract (bf16, as on a GPU) -> weights on the tiny Llama, 24 samples, a reduced draft
    vocab."""
    from pipeline import prepare, weights
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.stage import run as extract_run

    root = tmp_path_factory.mktemp("interop")
    prepare.run(
        prepare.PrepareConfig(
            data=conversations,
            model=tiny_llama,
            out=root / "prepared",
            seq_length=128,
            draft_vocab_size=DRAFT_VOCAB,
            max_samples=24,
        )
    )
    extract_run(
        ExtractConfig(
            prepared=root / "prepared",
            model=tiny_llama,
            out=root / "hidden_states",
            device="cpu",
            dtype="bfloat16",
            verify=False,
            progress=False,
        )
    )
    weights.run(tiny_llama, root / "verifier")
    assert formats.read_data_config(root / "hidden_states").dtype == "bfloat16"
    return root


@pytest.fixture(scope="module")
def exported(ours, warm_pipeline) -> Path:
    out = ours / "speculators"
    proc = warm_pipeline(
        "export-speculators", "--prepared", ours / "prepared", "--data", ours / "hidden_states", "--out", out
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # no progress bars on a stage's stderr
    return out


def _speculators_train(data: Path, save: Path, args: list[str]) -> subprocess.CompletedProcess:
    """speculators' own CLI (`python -m speculators train`), unchanged; on a CPU host with the two-line
    device shim of tests/train/speculators_cpu (its trainer needs an accelerator otherwise)."""
    env = {**os.environ, "COLUMNS": "200"}
    if torch.accelerator.current_accelerator() is None:
        env["PYTHONPATH"] = str(CPU_SHIM)
    cmd = [
        sys.executable,
        "-m",
        "speculators",
        "train",
        "--data-path",
        str(data),
        *args,
        "--save-path",
        str(save),
        "--epochs",
        "1",
        "--max-steps",
        "2",
        "--total-seq-len",
        "256",
        "--num-workers",
        "0",
        "--hidden-states-dtype",
        "float32",
        "--draft-attn-impl",
        "sdpa",
        "--loss-implementation",
        "eager",
        "--lr",
        "1e-3",
    ]
    return subprocess.run(
        cmd, check=False, capture_output=True, text=True, cwd=save.parent, env=env, timeout=900
    )


def test_speculators_own_train_cli_trains_from_our_export(exported, tmp_path):
    """`speculators train` with the flags export-speculators prints reads every exported sample, trains two
    steps and writes a checkpoint with our layer ids and our vocab mapping."""
    record = json.loads((exported / interop.RECORD).read_text())
    proc = _speculators_train(exported, tmp_path / "ckpt", record["speculators_train_args"])
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "match input ids" not in log and "unavailable" not in log.lower(), log[
        -4000:
    ]  # no sample was dropped
    ckpt = tmp_path / "ckpt" / "0"
    state = json.loads((ckpt / "training_state.json").read_text())
    assert state["global_step"] == 2
    val = json.loads((ckpt / "val_metrics.json").read_text())
    assert math.isfinite(val["loss_epoch"]) and val["loss_epoch"] > 0
    config = json.loads((ckpt / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6]  # our outputs [2, 4, 5] + 1; 7 is the last
    weights = load_file(str(ckpt / "model.safetensors"))
    d2t, t2d = formats.read_vocab(exported.parent / "prepared")
    assert np.array_equal(weights["d2t"].numpy(), d2t) and np.array_equal(weights["t2d"].numpy(), t2d)


def test_exported_files_are_vllms_native_layout(ours, exported):
    """hs_{i}.safetensors holds exactly vLLM's two keys: hidden_states [T, 4, H] (last layer last, our dtype)
    and token_ids int64 [T]; the dataset rows are the prepared rows."""
    from datasets import load_from_disk

    samples, _ = formats.read_prepared(ours / "prepared")
    dataset = load_from_disk(str(exported))
    assert len(dataset) == len(samples) == len(interop.hs_indices(exported / "hidden_states"))
    for i in (0, len(samples) - 1):
        ref = formats.read_sample(formats.data_file(ours / "hidden_states", i))
        hs = load_file(str(interop.hs_file(exported / "hidden_states", i)))
        assert sorted(hs) == ["hidden_states", "token_ids"]
        assert hs["token_ids"].dtype == torch.int64 and torch.equal(hs["token_ids"], ref["input_ids"])
        assert hs["hidden_states"].shape == (samples.length(i), 4, ref["hidden_states"][0].shape[-1])
        assert torch.equal(hs["hidden_states"][:, -1], ref["hidden_states"][-1])
        row = dataset[i]
        assert row["input_ids"].dtype == torch.int64 and row["input_ids"].tolist() == samples.ids(i).tolist()
        assert row["loss_mask"].tolist() == samples.mask(i).tolist() and int(
            row["seq_len"]
        ) == samples.length(i)


def _assert_same_sets(a: Path, b: Path, *, same_metadata: bool = True) -> None:
    sa, ma = formats.read_prepared(a / "prepared")
    sb, mb = formats.read_prepared(b / "prepared")
    for name in ("tokens", "loss_mask", "offsets"):
        x, y = getattr(sa, name), getattr(sb, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    for x, y in zip(formats.read_vocab(a / "prepared"), formats.read_vocab(b / "prepared"), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert formats.read_token_freq(a / "prepared" / formats.TOKEN_FREQ) == formats.read_token_freq(
        b / "prepared" / formats.TOKEN_FREQ
    )
    if same_metadata:
        assert asdict(ma) == asdict(mb)
    indices = formats.existing_data_indices(a / "hidden_states")
    assert indices == formats.existing_data_indices(b / "hidden_states") and indices
    for i in indices:
        x = formats.read_sample(formats.data_file(a / "hidden_states", i))
        y = formats.read_sample(formats.data_file(b / "hidden_states", i))
        for key in ("input_ids", "loss_mask"):
            assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), (i, key)
        assert len(x["hidden_states"]) == len(y["hidden_states"]) == 4
        for hx, hy in zip(x["hidden_states"], y["hidden_states"], strict=True):
            assert hx.dtype == hy.dtype and torch.equal(hx, hy), i
    assert formats.read_sample_lengths(a / "hidden_states") == formats.read_sample_lengths(
        b / "hidden_states"
    )


def test_round_trip_ours_speculators_ours_is_identical(ours, exported, tmp_path, warm_pipeline):
    """import-speculators of our export gives back the same arrays, tensors (dtype and bits), vocab
    mapping, token counts and records; `pipeline verify` passes on the result."""
    back = tmp_path / "back"
    proc = warm_pipeline("import-speculators", "--data", exported, "--out", back)
    assert proc.returncode == 0, proc.stderr
    _assert_same_sets(ours, back)
    dc_a, dc_b = (
        formats.read_data_config(ours / "hidden_states"),
        formats.read_data_config(back / "hidden_states"),
    )
    assert {**asdict(dc_a), "prepared": ""} == {**asdict(dc_b), "prepared": ""}
    assert Path(dc_b.prepared) == (back / "prepared").resolve()
    verify = warm_pipeline("verify", back / "hidden_states")
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr


def test_vllm_native_set_imports_and_our_train_trains_on_it(ours, exported, tiny_llama, tmp_path):
    """A set as vLLM's extraction + `speculators prepare-data` leave it (no eagle-ops.json, vLLM layer ids
    given) imports to the same tensors, and `pipeline train` trains a draft from it."""
    native = tmp_path / "native"
    shutil.copytree(exported, native)
    (native / interop.RECORD).unlink()
    back = tmp_path / "back"
    proc = run_pipeline(
        "import-speculators", "--data", native, "--out", back, "--model", tiny_llama, "--layer-ids", "3,5,6,8"
    )
    assert proc.returncode == 0, proc.stderr
    _assert_same_sets(ours, back, same_metadata=False)
    assert formats.read_data_config(back / "hidden_states").layer_ids == [2, 4, 5, 7]
    train = run_pipeline(
        "train",
        "--data",
        back / "hidden_states",
        "--verifier",
        ours / "verifier",
        "--out",
        tmp_path / "draft",
        "--epochs",
        1,
        "--max-len",
        256,
        "--device",
        "cpu",
        "--no-plots",
        timeout=900,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    assert (tmp_path / "draft" / "draft" / "config.json").is_file(), sorted(
        p.name for p in (tmp_path / "draft").iterdir()
    )


def _one_line_exit_2(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_inputs_get_one_line_and_exit_2(ours, exported, tiny_llama, tmp_path, warm_pipeline):
    """Missing dirs, a sample count that does not match, a non-empty --out, a missing, foreign or torn hs
    file, a foreign set without (or with wrong) layer ids are each refused in one line, exit 2, and --out
    stays untouched. Each is a real `python -m pipeline` process, forked warm (tests/warm_cli.py): ~0.2 s
    instead of ~4.5 s."""
    prep, data = ours / "prepared", ours / "hidden_states"
    _one_line_exit_2(
        warm_pipeline(
            "export-speculators", "--prepared", tmp_path / "nope", "--data", data, "--out", tmp_path / "o1"
        ),
        "nope",
        "not a directory",
    )
    _one_line_exit_2(
        warm_pipeline("import-speculators", "--data", tmp_path / "nope", "--out", tmp_path / "o2"),
        "not a directory",
    )
    short = tmp_path / "short"
    shutil.copytree(data, short)
    formats.data_file(short, 3).unlink()
    _one_line_exit_2(
        warm_pipeline("export-speculators", "--prepared", prep, "--data", short, "--out", tmp_path / "o3"),
        "data_3.pt",
        "24 prepared samples",
    )
    assert not (tmp_path / "o3").exists()
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    shutil.copyfile(formats.data_file(moved, 4), formats.data_file(moved, 3))
    _one_line_exit_2(
        warm_pipeline("export-speculators", "--prepared", prep, "--data", moved, "--out", tmp_path / "o9"),
        "data_3.pt",
        "prepared sample 3",
    )
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    _one_line_exit_2(
        warm_pipeline("export-speculators", "--prepared", prep, "--data", data, "--out", busy),
        "not empty",
        "--overwrite",
    )
    assert sorted(p.name for p in busy.iterdir()) == ["keep.txt"]
    gap = tmp_path / "gap"
    shutil.copytree(exported, gap)
    interop.hs_file(gap / "hidden_states", 5).unlink()
    _one_line_exit_2(
        warm_pipeline("import-speculators", "--data", gap, "--out", tmp_path / "o4"),
        "hs_5.safetensors",
        "23 hs_",
    )
    assert not (tmp_path / "o4").exists()
    swapped = tmp_path / "swapped"
    shutil.copytree(exported, swapped)
    one = load_file(str(interop.hs_file(swapped / "hidden_states", 1)))
    save_file(one, str(interop.hs_file(swapped / "hidden_states", 2)))
    _one_line_exit_2(
        warm_pipeline("import-speculators", "--data", swapped, "--out", tmp_path / "o5"),
        "hs_2.safetensors",
        "row 2",
    )
    foreign = tmp_path / "foreign"
    shutil.copytree(exported, foreign)
    (foreign / interop.RECORD).unlink()
    _one_line_exit_2(
        warm_pipeline("import-speculators", "--data", foreign, "--out", tmp_path / "o6"), "--layer-ids"
    )
    _one_line_exit_2(
        warm_pipeline(
            "import-speculators",
            "--data",
            foreign,
            "--out",
            tmp_path / "o7",
            "--model",
            tiny_llama,
            "--layer-ids",
            "2,4,5,7",
        ),
        "end with the final state, 8",
    )
    torn = tmp_path / "torn"
    shutil.copytree(exported, torn)
    path = interop.hs_file(torn / "hidden_states", 4)
    path.write_bytes(path.read_bytes()[:100])
    _one_line_exit_2(
        warm_pipeline("import-speculators", "--data", torn, "--out", tmp_path / "o8"),
        "hs_4.safetensors",
        "unreadable",
    )
    _one_line_exit_2(
        warm_pipeline(
            "import-speculators",
            "--data",
            data,
            "--out",
            tmp_path / "o10",
            "--model",
            tiny_llama,
            "--layer-ids",
            "3,5,6,8",
        ),
        "not a dataset written by",
    )
    assert not any((tmp_path / f"o{k}").exists() for k in range(1, 11))
