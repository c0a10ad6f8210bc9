"""bench/padded_target.py: the padded target computes what the learned one computes (fp32 on the CPU, the
tiny random Llama), with the layers and width asked, and its learned layers' outputs unchanged."""

from __future__ import annotations

import json

import pytest
import torch


def test_padding_adds_parameters_and_nothing_else(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    from bench.padded_target import pad_target

    base = json.loads((tiny_llama / "config.json").read_text())
    sizes = pad_target(
        tiny_llama, tmp_path / "padded", intermediate_size=4 * base["intermediate_size"], extra_layers=3
    )
    config = json.loads((tmp_path / "padded" / "config.json").read_text())
    assert config["num_hidden_layers"] == base["num_hidden_layers"] + 3 == sizes["layers"]
    assert config["intermediate_size"] == 4 * base["intermediate_size"]
    assert (tmp_path / "padded" / "tokenizer.json").is_file()
    small = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    padded = AutoModelForCausalLM.from_pretrained(tmp_path / "padded", dtype=torch.float32).eval()
    assert sum(p.numel() for p in padded.parameters()) == sizes["parameters"]
    assert sizes["parameters"] > 2 * sum(p.numel() for p in small.parameters())
    ids = torch.randint(3, base["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = small(ids, output_hidden_states=True)
        b = padded(ids, output_hidden_states=True)
    learned = base["num_hidden_layers"]
    # transformers' last hidden state is after the final norm: compare the embeddings and the learned layers'
    # outputs before it
    for i in range(learned):
        torch.testing.assert_close(b.hidden_states[i], a.hidden_states[i], rtol=1e-5, atol=1e-5)
    for i in (learned + 1, learned + 2):  # each padded layer adds exactly zero to the last learned output
        assert torch.equal(b.hidden_states[i], b.hidden_states[learned])
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(b.logits.argmax(-1), a.logits.argmax(-1))


def test_padding_only_grows(tiny_llama, tmp_path):
    from bench.padded_target import pad_target

    with pytest.raises(ValueError, match="padding only grows"):
        pad_target(tiny_llama, tmp_path / "p", intermediate_size=8, extra_layers=0)
    assert not (tmp_path / "p").exists()
