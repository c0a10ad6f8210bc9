"""The learned tiny target (pipeline/demo/learned.py): a real Llama with tokenizer and chat template, trained
on stdlib text."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_learned_target_is_a_loadable_model_trained_on_real_text(tmp_path):
    """The saved target loads with transformers, templates a chat, and its record shows training steps on the
    corpus."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.demo import learned

    out = learned.build_learned_model(tmp_path / "model", seconds=5, conversations=64, seq_length=64, batch=2)
    record = json.loads((out / learned.RECORD).read_text())
    assert record["steps"] >= 1 and record["corpus_files"] > 10
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "def f():"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 4 and model.config.vocab_size == len(tok)
    rows = [
        json.loads(line)
        for line in learned.write_conversations(tmp_path / "c.jsonl", n=5).read_text().splitlines()
    ]
    assert (
        len(rows) == 5
        and rows[0]["messages"][2]["role"] == "assistant"
        and rows[0]["messages"][2]["content"].strip()
    )
