"""More malformed inputs across the pipeline's flags, rows, model dirs and outputs: one line, exit 2, nothing
written. Each command is a real `python -m pipeline` process, forked warm (tests/warm_cli.py)."""

from __future__ import annotations

import json

import pytest


def assert_refused(proc, fragment: str, code: int = 2) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert err.startswith("error: ") and "\n" not in err and fragment in err, err


def test_enormous_row_is_refused(tmp_path, tiny_llama, warm_pipeline):
    """A row over the 16 MiB limit is named by line instead of being tokenized."""
    data = tmp_path / "rows.jsonl"
    big = json.dumps(
        {"messages": [{"role": "user", "content": "x" * (17 << 20)}, {"role": "assistant", "content": "y"}]}
    )
    data.write_text(big + "\n")
    assert_refused(
        warm_pipeline("prepare", "--data", data, "--model", tiny_llama, "--out", tmp_path / "p"), "over the"
    )
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}), "lacks num_hidden_layers"),
    ],
)
def test_broken_model_config(tmp_path, conversations, config, fragment, warm_pipeline):
    """config.json that is not JSON, or not a decoder LM config, is named."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config)
    assert_refused(
        warm_pipeline("prepare", "--data", conversations, "--model", model, "--out", tmp_path / "p"), fragment
    )
    assert_refused(warm_pipeline("weights", "--model", model, "--out", tmp_path / "v"), fragment)
    assert not (tmp_path / "p").exists() and not (tmp_path / "v").exists()


def test_unknown_architecture_fails_before_any_file(tmp_path, tiny_llama, prepared_llama, warm_pipeline):
    """An unknown model_type cannot be loaded: one line, and the output dir keeps only its config."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(model_type="not_a_real_arch", architectures=["NotARealForCausalLM"])
    (model / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "states"
    assert_refused(
        warm_pipeline("extract", "--prepared", prepared_llama, "--model", model, "--out", out), "cannot load"
    )
    assert not list(out.glob("data_*.pt"))


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--seq-length", "1"], "--seq-length 1"),
        (["--draft-vocab-size", "0"], "--draft-vocab-size 0"),
    ],
)
def test_prepare_flag_ranges(tmp_path, tiny_llama, conversations, flags, fragment, warm_pipeline):
    """Out-of-range numeric flags are refused up front."""
    assert_refused(
        warm_pipeline(
            "prepare", "--data", conversations, "--model", tiny_llama, "--out", tmp_path / "p", *flags
        ),
        fragment,
    )
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--limit", "0"], "--limit 0"),
        (["--max-batch-tokens", "0"], "--max-batch-tokens 0"),
        (["--resume", "--overwrite"], "contradict"),
        (["--dtype", "float8"], "unknown --dtype"),
        (["--layer-ids", "2,four,5,7"], "comma-separated integers"),
        (["--writer-threads", "0"], "--writer-threads 0"),
        (["--closing-check", "bytes"], "unknown --closing-check 'bytes': choose record or full"),
        (["--data-parallel", "2", "--device", "cuda:1"], "CUDA_VISIBLE_DEVICES"),
    ],
)
def test_extract_flag_errors(tmp_path, tiny_llama, prepared_llama, flags, fragment, warm_pipeline):
    """Contradictory or malformed extract flags are refused before the model loads."""
    out = tmp_path / "states"
    assert_refused(
        warm_pipeline("extract", "--prepared", prepared_llama, "--model", tiny_llama, "--out", out, *flags),
        fragment,
    )
    assert not out.exists() or not list(out.glob("data_*.pt"))


def test_extract_on_a_cuda_device_without_one(tmp_path, tiny_llama, prepared_llama, warm_pipeline):
    """--device cuda where torch sees no GPU is one line, before the model loads (was torch's traceback)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    out = tmp_path / "states"
    flags = ("--prepared", prepared_llama, "--model", tiny_llama, "--out", out, "--device", "cuda")
    assert_refused(warm_pipeline("extract", *flags), "sees no CUDA device")
    assert not out.exists() or not list(out.glob("data_*.pt"))


def test_verify_refuses_what_is_not_a_stage_output(tmp_path, warm_pipeline):
    """verify on a missing path or an unrelated directory says what it expected."""
    assert_refused(warm_pipeline("verify", tmp_path / "missing"), "not a directory")
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "notes.txt").write_text("hi")
    assert_refused(warm_pipeline("verify", tmp_path / "random"), "not a stage output")


def test_weights_without_safetensors(tmp_path, tiny_llama, warm_pipeline):
    """A model dir with config but no safetensors is refused with the missing file named."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((tiny_llama / "config.json").read_text())
    assert_refused(warm_pipeline("weights", "--model", model, "--out", tmp_path / "v"), "model.safetensors")
    assert not (tmp_path / "v").exists()
