"""prepare, weights and verify through their command lines: outputs, and bad input refused cleanly.
Each command is a real `python -m pipeline` process, forked warm (tests/warm_cli.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.ondisk import formats


def one_line_error(proc, fragment: str, code: int = 2) -> None:
    assert proc.returncode == code, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert fragment in err, err


def test_prepare_masks_assistant_text_only(prepared_llama, tiny_llama):
    """Masked tokens decode to the assistant turns (plus their end-of-turn token) and nothing else."""
    from transformers import AutoTokenizer

    samples, meta = formats.read_prepared(prepared_llama)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert meta.num_samples == len(samples) > 0 and meta.max_tokens == 127
    for i in range(5):
        ids, mask = samples.ids(i), samples.mask(i)
        masked = tok.decode(ids[mask == 1])
        unmasked = tok.decode(ids[mask == 0])
        assert "About " in masked and "<|start_header_id|>" not in masked
        assert "<|eot_id|>" in masked or len(ids) == 127
        assert "assistant<|end_header_id|>" in unmasked


def test_prepare_reads_sharegpt_and_openai_rows_identically(tmp_path, tiny_llama, warm_pipeline):
    """The same conversation in ShareGPT and OpenAI form yields the same tokens and mask."""
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Qu'est-ce que λ ?"},
        {"role": "assistant", "content": "Une lettre grecque ✓"},
    ]
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"messages": msgs})
        + "\n"
        + json.dumps({"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in msgs]})
        + "\n"
    )
    warm_pipeline("prepare", "--data", data, "--model", tiny_llama, "--out", tmp_path / "p", check=True)
    samples, _ = formats.read_prepared(tmp_path / "p")
    assert len(samples) == 2
    assert (
        samples.ids(0).tolist() == samples.ids(1).tolist()
        and samples.mask(0).tolist() == samples.mask(1).tolist()
    )
    assert 0 < samples.mask(0).sum() < len(samples.ids(0))


def test_prepare_truncates_and_writes_token_freq_and_vocab(prepared_llama):
    """Samples are cut to seq_length-1 tokens; token_freq.pt counts masked tokens; d2t/t2d are sound."""
    samples, meta = formats.read_prepared(prepared_llama)
    assert samples.lengths().max() <= 127 and meta.truncated_rows > 0
    freq = formats.read_token_freq(prepared_llama / formats.TOKEN_FREQ)
    assert sum(freq.values()) == int(samples.loss_mask.sum())
    d2t, t2d = formats.read_vocab(prepared_llama)
    assert len(d2t) == 128 and len(t2d) == meta.target_vocab_size and t2d.sum() == 128
    assert all(t2d[t] for t in freq)  # fewer distinct assistant tokens than 128: all of them are in


def test_existing_token_freq_is_an_error_unless_overwrite(tmp_path, tiny_llama, conversations, warm_pipeline):
    """A second prepare into the same dir refuses; --overwrite recomputes token_freq.pt."""
    out = tmp_path / "p"
    args = ["prepare", "--data", conversations, "--model", tiny_llama, "--out", out, "--max-samples", 5]
    warm_pipeline(*args, check=True)
    before = (out / formats.TOKEN_FREQ).read_bytes()
    (out / formats.TOKEN_FREQ).write_bytes(b"stale")
    one_line_error(warm_pipeline(*args), "--overwrite")
    assert (out / formats.TOKEN_FREQ).read_bytes() == b"stale"
    warm_pipeline(*args, "--overwrite", check=True)
    assert (out / formats.TOKEN_FREQ).read_bytes() == before


def test_prepare_stops_when_no_row_has_assistant_tokens(tmp_path, tiny_llama, warm_pipeline):
    """If masking yields no assistant token, prepare stops rather than produce nothing to train on."""
    data = tmp_path / "rows.jsonl"
    # the assistant turn is pushed past the truncation point by a long user turn
    rows = [
        {"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"}]}
    ] * 3
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = warm_pipeline(
        "prepare", "--data", data, "--model", tiny_llama, "--out", tmp_path / "p", "--seq-length", 64
    )
    one_line_error(proc, "no usable samples")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        (b'{"messages": []}', "conversation is empty"),
        (b'{"messages": [{"content": "hi"}]}', "lacks 'role'"),
        (
            b'{"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}',
            "unknown role",
        ),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
        (b'{"text": "hello"}', "neither 'messages' nor 'conversations'"),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "invalid UTF-8"),
        (b"{not json", "not valid JSON"),
    ],
)
def test_malformed_rows_are_named_by_line(tmp_path, tiny_llama, row, fragment, warm_pipeline):
    """A malformed row gives a one-line error with file:line and the reason; nothing is written."""
    data = tmp_path / "rows.jsonl"
    good = json.dumps(
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    ).encode()
    data.write_bytes(good + b"\n" + row + b"\n")
    proc = warm_pipeline("prepare", "--data", data, "--model", tiny_llama, "--out", tmp_path / "p")
    one_line_error(proc, fragment)
    assert "rows.jsonl:2" in proc.stderr
    assert not (tmp_path / "p").exists()


def test_skip_invalid_counts_skipped_rows(tmp_path, tiny_llama, warm_pipeline):
    """--skip-invalid keeps going and records how many rows were skipped."""
    data = tmp_path / "rows.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    data.write_text(f"{good}\n{{broken\n{good}\n")
    warm_pipeline(
        "prepare",
        "--data",
        data,
        "--model",
        tiny_llama,
        "--out",
        tmp_path / "p",
        "--skip-invalid",
        check=True,
    )
    meta = json.loads((tmp_path / "p" / "metadata.json").read_text())
    assert meta["num_samples"] == 2 and meta["skipped_rows"] == 1


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("missing-data", "data file"),
        ("missing-model", "does not exist"),
        ("no-config", "no config.json"),
        ("draft-too-big", "--draft-vocab-size"),
    ],
)
def test_prepare_bad_paths_and_flags(tmp_path, tiny_llama, conversations, case, fragment, warm_pipeline):
    """Missing files and impossible flags: one-line error, exit 2, no output dir."""
    model, data, extra = tiny_llama, conversations, []
    if case == "missing-data":
        data = tmp_path / "nope.jsonl"
    elif case == "missing-model":
        model = tmp_path / "no-model"
    elif case == "no-config":
        model = tmp_path / "empty-model"
        model.mkdir()
    else:
        extra = ["--draft-vocab-size", "999999"]
    proc = warm_pipeline("prepare", "--data", data, "--model", model, "--out", tmp_path / "p", *extra)
    one_line_error(proc, fragment)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("layer-ids", "exactly 4"),
        ("nonempty-out", "--resume"),
        ("vocab-mismatch", "prepared for a vocab of"),
        ("missing-prepared", "not a prepared dataset"),
    ],
)
def test_extract_bad_input_writes_nothing(
    tmp_path, tiny_llama, tiny_deepseek, prepared_llama, case, fragment, warm_pipeline
):
    """Wrong layer ids, a non-empty output, a prepared set from another vocab: refused before loading the
    model."""
    out = tmp_path / "states"
    model, prepared, extra = tiny_llama, prepared_llama, []
    if case == "layer-ids":
        extra = ["--layer-ids", "2,4,7"]
    elif case == "nonempty-out":
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
    elif case == "vocab-mismatch":
        model = tmp_path / "model"
        model.mkdir()
        cfg = json.loads((tiny_deepseek / "config.json").read_text())
        cfg["vocab_size"] = 2048
        (model / "config.json").write_text(json.dumps(cfg))
    else:
        prepared = tmp_path / "nothing"
    proc = warm_pipeline("extract", "--prepared", prepared, "--model", model, "--out", out, *extra)
    one_line_error(proc, fragment)
    if case == "nonempty-out":
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    else:
        assert not out.exists()


def test_resume_refuses_a_different_configuration(
    tmp_path, tiny_llama, prepared_llama, extracted_llama, warm_pipeline
):
    """--resume into a directory made with other layer ids is refused, naming the difference."""
    import shutil

    out = tmp_path / "states"
    shutil.copytree(extracted_llama, out)
    proc = warm_pipeline(
        "extract",
        "--prepared",
        prepared_llama,
        "--model",
        tiny_llama,
        "--out",
        out,
        "--limit",
        24,
        "--layer-ids",
        "1,3,5,7",
        "--resume",
    )
    one_line_error(proc, "layer_ids")


def test_weights_reads_three_tensors_and_handles_tied_and_wrapped_models(tmp_path, tiny_llama, warm_pipeline):
    """Plain model: names resolved, shapes right. Wrapper with shards and tied embeddings: lm_head = embed."""
    from safetensors.torch import load_file, save_file

    warm_pipeline("weights", "--model", tiny_llama, "--out", tmp_path / "v", check=True)
    v = load_file(tmp_path / "v" / "verifier.safetensors")
    src = load_file(tiny_llama / "model.safetensors")
    assert torch.equal(v["lm_head.weight"], src["lm_head.weight"]) and torch.equal(
        v["norm.weight"], src["model.norm.weight"]
    )

    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    cfg = {
        **json.loads((tiny_llama / "config.json").read_text()),
        "num_hidden_layers": 1,
    }  # the one layer below
    (wrapped / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["KimiK25ForConditionalGeneration"],
                "text_config": cfg,
                "tie_word_embeddings": True,
            }
        )
    )
    shard1 = {
        "language_model.model.embed_tokens.weight": src["model.embed_tokens.weight"],
        "vision_tower.embed_tokens.weight": torch.zeros(3, 3),
    }
    shard2 = {
        "language_model.model.norm.weight": src["model.norm.weight"],
        "language_model.model.layers.0.input_layernorm.weight": src["model.layers.0.input_layernorm.weight"],
    }
    save_file(shard1, wrapped / "model-00001-of-00002.safetensors")
    save_file(shard2, wrapped / "model-00002-of-00002.safetensors")
    wmap = {
        **{k: "model-00001-of-00002.safetensors" for k in shard1},
        **{k: "model-00002-of-00002.safetensors" for k in shard2},
    }
    (wrapped / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    warm_pipeline("weights", "--model", wrapped, "--out", tmp_path / "vw", check=True)
    vw = load_file(tmp_path / "vw" / "verifier.safetensors")
    meta = json.loads((tmp_path / "vw" / "verifier.json").read_text())
    assert meta["tied_word_embeddings"] is True
    assert meta["names"]["embed_tokens.weight"] == "language_model.model.embed_tokens.weight"
    assert torch.equal(vw["lm_head.weight"], src["model.embed_tokens.weight"])
    assert warm_pipeline("verify", tmp_path / "vw").returncode == 0


def test_weights_never_reads_other_tensors(tiny_llama, tmp_path, monkeypatch):
    """Only the three verifier tensors are read from the shards."""
    import safetensors

    from pipeline import weights

    read = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.inner = real(*a, **k)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    weights.run(tiny_llama, tmp_path / "v")
    assert sorted(read) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]


def test_verify_names_corrupt_missing_and_wrong_dtype_files(tmp_path, extracted_llama, warm_pipeline):
    """A truncated file, a gap and a wrong dtype each fail verify, naming the file and the check."""
    import shutil

    d = tmp_path / "states"
    shutil.copytree(extracted_llama, d)
    (d / "data_3.pt").write_bytes((d / "data_3.pt").read_bytes()[:500])
    (d / "data_5.pt").unlink()
    sample = formats.read_sample(d / "data_8.pt")
    formats.write_sample(
        d / "data_8.pt",
        sample["input_ids"],
        [h.to(torch.float16) for h in sample["hidden_states"]],
        sample["loss_mask"],
    )
    sample = formats.read_sample(d / "data_9.pt")
    sample["hidden_states"][1][0, 0] = float("nan")
    formats.write_sample(d / "data_9.pt", sample["input_ids"], sample["hidden_states"], sample["loss_mask"])
    proc = warm_pipeline("verify", d)
    assert proc.returncode == 3, proc.stderr
    summary = json.loads((d / "summary.json").read_text())
    failed = {(c["file"], c["name"]) for c in summary["checks"] if c["status"] == "fail"}
    assert ("data_3.pt", "loadable") in failed
    assert ("data_8.pt", "shape_dtype") in failed
    assert ("data_9.pt", "nan_inf") in failed
    assert any(
        c["name"] == "contiguity" and "data_5" in c["detail"]
        for c in summary["checks"]
        if c["status"] == "fail"
    )


@pytest.mark.parametrize("corruption", ["normed-twice", "wrong-layer"])
def test_alignment_passes_on_pre_norm_states_and_fails_on_wrong_ones(
    tmp_path, extracted_llama, tiny_llama, corruption, warm_pipeline
):
    """lm_head(norm(last)) matches the target's argmax; an already-normed or wrong-layer last state fails."""
    import shutil

    ok = warm_pipeline("verify", extracted_llama, "--model", tiny_llama)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    rows = json.loads((extracted_llama / "summary.json").read_text())["stats"]["alignment"]
    assert rows and all(r["agreement"] >= 0.99 for r in rows.values())

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    d = tmp_path / "states"
    shutil.copytree(extracted_llama, d)
    for i in range(24):
        s = formats.read_sample(d / f"data_{i}.pt")
        with torch.inference_mode():
            last = (
                model.model.norm(s["hidden_states"][-1])
                if corruption == "normed-twice"
                else s["hidden_states"][0]
            )
        formats.write_sample(
            d / f"data_{i}.pt", s["input_ids"], [*s["hidden_states"][:-1], last.clone()], s["loss_mask"]
        )
    (
        d / formats.CHECKSUMS
    ).unlink()  # as a set written wrong from the start: no checksum names the files first
    bad = warm_pipeline("verify", d, "--model", tiny_llama, "--recompute-samples", 0)
    assert bad.returncode == 3 and "alignment" in bad.stderr
    # the target, computed again beside another sample, agrees with itself: the states are named as the fault
    summary = json.loads((d / "summary.json").read_text())
    failed = [c for c in summary["checks"] if c["name"] == "alignment" and c["status"] == "fail"]
    assert failed and all("states are not the last layer's pre-norm output" in c["detail"] for c in failed)
    rows = summary["stats"]["alignment"]
    assert all(rows[c["file"]]["self_agreement"] >= 0.99 for c in failed)


def test_verify_prepared_catches_a_broken_vocab_file(tmp_path, prepared_llama, warm_pipeline):
    """A d2t that no longer matches t2d fails the prepared-data verification."""
    import shutil

    d = tmp_path / "p"
    shutil.copytree(prepared_llama, d)
    d2t = np.load(d / "d2t.npy")
    np.save(d / "d2t.npy", d2t[:-1])
    proc = warm_pipeline("verify", d)
    assert proc.returncode == 3 and "vocab_mapping" in proc.stderr
