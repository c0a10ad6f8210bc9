"""Damaged files the stages read (config.json, tokenizer, safetensors index and shards, our own index files,
arrays and torch files): one line naming the file, what is wrong and what to do; exit 2 in a stage, a failed
named check (exit 3) in verify; never a traceback, nothing written."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import run_pipeline


def cli(monkeypatch, capsys, *args) -> tuple[int, str]:
    """``python -m pipeline ARGS`` in this process (the CLI's own entry point): exit code and stderr."""
    from pipeline.cli import run

    monkeypatch.setattr(sys, "argv", ["pipeline", *map(str, args)])
    capsys.readouterr()
    try:
        run()
    except SystemExit as exc:
        return int(exc.code or 0), capsys.readouterr().err.strip()
    return 0, capsys.readouterr().err.strip()


def refused(result: tuple[int, str], *fragments: str, code: int = 2) -> None:
    """The process exited ``code`` with one line starting ``error:`` that holds every fragment."""
    rc, err = result
    assert rc == code, err
    assert err.startswith("error: ") and "\n" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def linked_copy(src: Path, dst: Path, *replaced: str) -> Path:
    """``dst`` with a symlink to each file of ``src``, except ``replaced`` (left for the test to write)."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name not in replaced:
            (dst / p.name).symlink_to(p.resolve(), target_is_directory=p.is_dir())
    return dst


def _config(tiny_llama: Path, **changes) -> bytes:
    raw = json.loads((tiny_llama / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return json.dumps(raw).encode()


CONFIGS = {
    "json-array": (lambda m: b"[1, 2]", "is a JSON array, expected an object"),
    "not-utf8": (lambda m: b"\xff\xfe{\x00}", "not UTF-8"),
    "empty": (lambda m: b"", "empty"),
    "layers-as-string": (lambda m: _config(m, num_hidden_layers="8"), "num_hidden_layers = '8'"),
    "layers-as-bool": (lambda m: _config(m, num_hidden_layers=True), "num_hidden_layers = True"),
    "hidden-negative": (lambda m: _config(m, hidden_size=-256), "hidden_size = -256"),
    "vocab-zero": (lambda m: _config(m, vocab_size=0), "vocab_size = 0"),
    "text-config-list": (lambda m: _config(m, text_config=[1]), "text_config is a JSON array"),
    "tie-as-string": (lambda m: _config(m, tie_word_embeddings="yes"), "tie_word_embeddings = 'yes'"),
    "architectures-string": (lambda m: _config(m, architectures="LlamaForCausalLM"), "architectures ="),
}


@pytest.mark.parametrize("stage", ["prepare", "weights", "extract"])
@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_damaged_config_json_is_one_line_in_every_stage(
    tmp_path, monkeypatch, capsys, tiny_llama, conversations, prepared_llama, stage, case
):
    """A config.json of the wrong shape or types is named with what is wrong, exit 2, before any output."""
    make, fragment = CONFIGS[case]
    model = linked_copy(tiny_llama, tmp_path / "model", "config.json")
    (model / "config.json").write_bytes(make(tiny_llama))
    out = tmp_path / "out"
    args = {
        "prepare": ["--data", conversations, "--model", model, "--out", out],
        "weights": ["--model", model, "--out", out],
        "extract": ["--prepared", prepared_llama, "--model", model, "--out", out, "--no-progress"],
    }[stage]
    refused(cli(monkeypatch, capsys, stage, *args), str(model / "config.json"), fragment)
    assert not out.exists()


def test_config_json_that_is_a_directory(tmp_path, monkeypatch, capsys, tiny_llama):
    """A directory named config.json is not taken for a model config."""
    model = linked_copy(tiny_llama, tmp_path / "model", "config.json")
    (model / "config.json").mkdir()
    refused(cli(monkeypatch, capsys, "weights", "--model", model, "--out", tmp_path / "v"), "config.json")


TOKENIZERS = {
    "truncated-tokenizer-json": ("tokenizer.json", lambda b: b[: len(b) // 2]),
    "tokenizer-config-not-json": ("tokenizer_config.json", lambda b: b"{chat_template: nope"),
    "tokenizer-json-random": ("tokenizer.json", lambda b: bytes(range(256)) * 8),
}


@pytest.mark.parametrize("case", sorted(TOKENIZERS))
def test_damaged_tokenizer_is_one_line(tmp_path, monkeypatch, capsys, tiny_llama, conversations, case):
    """prepare names the tokenizer it cannot load instead of raising the tokenizers library's exception."""
    name, damage = TOKENIZERS[case]
    model = linked_copy(tiny_llama, tmp_path / "model", name)
    (model / name).write_bytes(damage((tiny_llama / name).read_bytes()))
    refused(
        cli(
            monkeypatch, capsys, "prepare", "--data", conversations, "--model", model, "--out", tmp_path / "p"
        ),
        "cannot load the tokenizer",
        str(model),
    )
    assert not (tmp_path / "p").exists()


def _index(model: Path, weight_map) -> None:
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def _tiny_names(tiny_llama: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(tiny_llama / "model.safetensors"), framework="pt") as fh:
        return list(fh.keys())


def _damage_checkpoint(case: str, model: Path, tiny_llama: Path) -> str:
    names = _tiny_names(tiny_llama)
    shard = (tiny_llama / "model.safetensors").read_bytes()
    if case == "index-array":
        (model / "model.safetensors.index.json").write_text("[]")
        return "is a JSON array"
    if case == "index-not-json":
        (model / "model.safetensors.index.json").write_text("{weight_map")
        return "not valid JSON"
    if case == "weight-map-list":
        _index(model, names)
        return "no weight_map object"
    if case == "weight-map-number":
        _index(model, {**dict.fromkeys(names, "model.safetensors"), "lm_head.weight": 3})
        return "is not a shard file name"
    if case == "weight-map-escapes":
        _index(model, {**dict.fromkeys(names, "model.safetensors"), "lm_head.weight": "../../etc/passwd"})
        return "is not a shard file name"
    if case == "shard-lacks-tensor":
        (model / "other.safetensors").symlink_to((tiny_llama / "model.safetensors").resolve())
        _index(
            model,
            {
                **dict.fromkeys(names, "model.safetensors"),
                "model.norm.weight": "model.safetensors",
                "lm_head.weight": "model.safetensors",
                "model.embed_tokens.weight": "empty.safetensors",
            },
        )
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(1)}, str(model / "empty.safetensors"))
        return "has no tensor 'model.embed_tokens.weight'"
    if case == "shard-missing":
        _index(model, {**dict.fromkeys(names, "model.safetensors"), "lm_head.weight": "gone.safetensors"})
        return "is missing"
    (model / "model.safetensors").unlink()
    if case == "shard-truncated":
        (model / "model.safetensors").write_bytes(shard[: len(shard) // 2])
    elif case == "shard-random":
        (model / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))
    elif case == "shard-empty":
        (model / "model.safetensors").write_bytes(b"")
    return "not a readable safetensors file"


CHECKPOINTS = [
    "index-array",
    "index-not-json",
    "weight-map-list",
    "weight-map-number",
    "weight-map-escapes",
    "shard-lacks-tensor",
    "shard-missing",
    "shard-truncated",
    "shard-random",
    "shard-empty",
]


@pytest.mark.parametrize("case", CHECKPOINTS)
def test_damaged_checkpoint_is_one_line_in_weights(tmp_path, monkeypatch, capsys, tiny_llama, case):
    """weights names the damaged index or shard and what is wrong with it; no verifier is written."""
    model = linked_copy(tiny_llama, tmp_path / "model", "model.safetensors")
    (model / "model.safetensors").symlink_to((tiny_llama / "model.safetensors").resolve())
    fragment = _damage_checkpoint(case, model, tiny_llama)
    refused(cli(monkeypatch, capsys, "weights", "--model", model, "--out", tmp_path / "v"), fragment)
    assert not (tmp_path / "v").exists()


def _save_npy(path: Path, array, **kwargs) -> None:
    path.unlink(missing_ok=True)
    with open(path, "wb") as fh:
        np.save(fh, array, **kwargs)


PREPARED = {
    "metadata-array": ("metadata.json", lambda p: p.write_text("[]"), "is a JSON array"),
    "metadata-not-utf8": ("metadata.json", lambda p: p.write_bytes(b"\xc3\x28"), "not UTF-8"),
    "metadata-count-string": ("metadata.json", 'num_samples="60"', "num_samples is string"),
    "metadata-lacks-count": ("metadata.json", "num_samples", "lacks num_samples"),
    "tokens-truncated": ("tokens.npy", "truncate", "tokens.npy: not a readable .npy array"),
    "tokens-random": (
        "tokens.npy",
        lambda p: p.write_bytes(b"\x93NUMPY garbage" * 10),
        "tokens.npy: not a readable",
    ),
    "offsets-pickle": (
        "offsets.npy",
        lambda p: _save_npy(p, np.array([{}, 1], dtype=object), allow_pickle=True),
        "offsets.npy: not a readable .npy array",
    ),
    "offsets-2d": ("offsets.npy", lambda p: _save_npy(p, np.zeros((2, 31), dtype=np.int64)), "expected 1-D"),
}


def _damage(path: Path, how) -> None:
    data = path.read_bytes()
    path.unlink()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif isinstance(how, str) and "=" in how:
        key, value = how.split("=", 1)
        path.write_text(json.dumps({**json.loads(data), key: json.loads(value)}))
    elif isinstance(how, str):
        raw = json.loads(data)
        raw.pop(how)
        path.write_text(json.dumps(raw))
    else:
        how(path)


@pytest.mark.parametrize("case", sorted(PREPARED))
def test_damaged_prepared_set_is_one_line_in_extract_and_a_failed_check_in_verify(
    tmp_path, monkeypatch, capsys, tiny_llama, prepared_llama, case
):
    """extract refuses a damaged prepared file by name (exit 2, no output); verify reports it failed
    (exit 3)."""
    name, how, fragment = PREPARED[case]
    prepared = linked_copy(prepared_llama, tmp_path / "prepared", name)
    shutil.copyfile(prepared_llama / name, prepared / name)
    _damage(prepared / name, how)
    out = tmp_path / "states"
    refused(
        cli(
            monkeypatch,
            capsys,
            "extract",
            "--prepared",
            prepared,
            "--model",
            tiny_llama,
            "--out",
            out,
            "--no-progress",
        ),
        name,
        fragment,
    )
    assert not out.exists()
    refused(cli(monkeypatch, capsys, "verify", prepared), name, fragment, code=3)


VOCAB = {
    "token-freq-truncated": ("token_freq.pt", "truncate", "not a readable torch file"),
    "token-freq-list": ("token_freq.pt", lambda p: torch.save([1, 2], p), "holds a list"),
    "token-freq-negative": ("token_freq.pt", lambda p: torch.save({3: -1}, p), "not a non-negative integer"),
    "d2t-truncated": ("d2t.npy", "truncate", "d2t.npy: not a readable .npy array"),
    "t2d-random": ("t2d.npy", lambda p: p.write_bytes(b"\x00" * 100), "t2d.npy: not a readable .npy array"),
}


@pytest.mark.parametrize("case", sorted(VOCAB))
def test_damaged_vocab_files_fail_verify_by_name(tmp_path, monkeypatch, capsys, prepared_llama, case):
    """verify of a prepared set with a damaged token_freq.pt, d2t.npy or t2d.npy is a failed check naming
    it."""
    name, how, fragment = VOCAB[case]
    prepared = linked_copy(prepared_llama, tmp_path / "prepared", name)
    shutil.copyfile(prepared_llama / name, prepared / name)
    _damage(prepared / name, how)
    refused(cli(monkeypatch, capsys, "verify", prepared), name, fragment, code=3)
    summary = json.loads((prepared / "summary.json").read_text())
    assert not summary["ok"] and any(name in c["detail"] for c in summary["checks"] if c["status"] == "fail")


STATES = {
    "data-config-array": ("data_config.json", lambda p: p.write_text("[]"), "is a JSON array"),
    "layer-ids-string": ("data_config.json", 'layer_ids="2,4,5,7"', "layer_ids is string"),
    "layer-ids-floats": ("data_config.json", "layer_ids=[2.5, 4, 5, 7]", "layer_ids is array"),
    "lacks-hidden-size": ("data_config.json", "hidden_size", "lacks hidden_size"),
    "sample-lengths-array": ("sample_lengths.json", lambda p: p.write_text("[3]"), "is a JSON array"),
    "sample-lengths-bad-key": (
        "sample_lengths.json",
        lambda p: p.write_text('{"zero": 3}'),
        "not an integer",
    ),
}


@pytest.mark.parametrize("case", sorted(STATES))
def test_damaged_hidden_states_index_fails_verify_and_resume_by_name(
    tmp_path, monkeypatch, capsys, tiny_llama, prepared_llama, extracted_llama, case
):
    """A damaged data_config.json or sample_lengths.json: verify exit 3 naming it; extract --resume exit 2."""
    name, how, fragment = STATES[case]
    states = tmp_path / "states"
    shutil.copytree(extracted_llama, states)
    _damage(states / name, how)
    refused(cli(monkeypatch, capsys, "verify", states), name, fragment, code=3)
    if name == "data_config.json":
        before = sorted(p.name for p in states.iterdir())
        refused(
            cli(
                monkeypatch,
                capsys,
                "extract",
                "--prepared",
                prepared_llama,
                "--model",
                tiny_llama,
                "--out",
                states,
                "--limit",
                24,
                "--resume",
                "--no-progress",
            ),
            name,
            fragment,
        )
        assert sorted(p.name for p in states.iterdir()) == before


@pytest.mark.parametrize("case", ["verifier-truncated", "verifier-json-array"])
def test_damaged_verifier_fails_verify_by_name(tmp_path, monkeypatch, capsys, tiny_llama, case):
    """A truncated verifier.safetensors or a verifier.json that is not an object is a failed check
    (exit 3)."""
    out = tmp_path / "v"
    assert cli(monkeypatch, capsys, "weights", "--model", tiny_llama, "--out", out)[0] == 0
    if case == "verifier-truncated":
        data = (out / "verifier.safetensors").read_bytes()
        (out / "verifier.safetensors").write_bytes(data[: len(data) // 3])
        fragment = "verifier.safetensors: not a readable safetensors file"
    else:
        (out / "verifier.json").write_text("[]")
        fragment = "verifier.json: is a JSON array"
    refused(cli(monkeypatch, capsys, "verify", out), fragment, code=3)


def test_a_damaged_file_is_one_line_through_the_real_command_line(tmp_path, tiny_llama, prepared_llama):
    """The same promise across a real process: a truncated tokens.npy is one stderr line and exit 2."""
    prepared = linked_copy(prepared_llama, tmp_path / "prepared", "tokens.npy")
    data = (prepared_llama / "tokens.npy").read_bytes()
    (prepared / "tokens.npy").write_bytes(data[:100])
    proc = run_pipeline("extract", "--prepared", prepared, "--model", tiny_llama, "--out", tmp_path / "s")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "tokens.npy" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
