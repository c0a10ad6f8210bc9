"""A tiny target that has learned something: a small Llama trained for about a minute on real offline text.

Owns the CPU recipe of issue #17 item 4 that ``make demo`` can use instead of the random target (a random
target's greedy tokens are noise no draft can predict, so its acceptance table means nothing):

* the corpus: the Python standard library's own sources (``sysconfig``'s stdlib dir, a fixed list of
  packages, files in sorted order), which exist on every machine with Python and need no download;
* conversations made from it: "continue this code" prompts whose answers are the code that follows;
* a byte-level BPE tokenizer trained on the corpus, with the demo's chat template (pipeline/tiny.py);
* a 4-layer Llama trained on the chat-templated conversations for ``seconds`` of wall time, saved in
  bf16 with the tokenizer; ``learned.json`` records the steps and the loss before and after.

Deterministic up to the time budget (the number of steps depends on the machine).
"""

from __future__ import annotations

import json
import random
import shutil
import sysconfig
import time
from pathlib import Path

from pipeline.atomic import atomic_path, write_json

STDLIB_PACKAGES = ("json", "email", "http", "logging", "urllib", "concurrent", "importlib", "xml", "sqlite3", "asyncio")
SYSTEM = "You are a Python expert. Continue the code exactly as the standard library writes it."
RECORD = "learned.json"


def corpus_texts(max_chars: int = 600_000) -> list[tuple[str, str]]:
    """(name, text) of standard-library source files, in a fixed order, up to ``max_chars`` in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for package in STDLIB_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "test" in path.parts or "tests" in path.parts:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            out.append((str(path.relative_to(root)), text))
            total += len(text)
            if total >= max_chars:
                return out
    return out


def make_conversations(texts: list[tuple[str, str]], n: int, seed: int = 0, prompt_lines: int = 6,
                       answer_lines: int = 10) -> list[dict]:
    """``n`` conversations: the user shows ``prompt_lines`` lines of a file, the assistant writes the next ones."""
    rng = random.Random(seed)
    rows = []
    files = [(name, text.splitlines()) for name, text in texts if text.count("\n") > prompt_lines + answer_lines]
    while len(rows) < n:
        name, lines = files[rng.randrange(len(files))]
        start = rng.randrange(len(lines) - prompt_lines - answer_lines)
        shown = "\n".join(lines[start : start + prompt_lines])
        answer = "\n".join(lines[start + prompt_lines : start + prompt_lines + answer_lines])
        if not answer.strip():
            continue
        rows.append({"messages": [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": f"Continue {name}:\n{shown}"},
                                  {"role": "assistant", "content": answer}]})
    return rows


def write_conversations(path: Path, n: int = 300, seed: int = 0) -> Path:
    """The demo's conversations for the learned target (JSONL, OpenAI ``messages`` form)."""
    rows = make_conversations(corpus_texts(), n, seed + 1000)  # other draws than the training conversations
    with atomic_path(Path(path)) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return Path(path)


def _batches(tokenizer, rows: list[dict], seq_length: int, batch: int, rng: random.Random):
    import torch

    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    ids = [x[:seq_length] for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    while True:
        chosen = [ids[rng.randrange(len(ids))] for _ in range(batch)]
        width = max(len(x) for x in chosen)
        tokens = torch.full((batch, width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        for i, x in enumerate(chosen):
            tokens[i, : len(x)] = torch.tensor(x)
            labels[i, : len(x)] = torch.tensor(x)
        yield tokens, labels


def build_learned_model(out_dir: Path, *, seconds: float = 60.0, seed: int = 0, conversations: int = 2000,
                        seq_length: int = 256, batch: int = 8, lr: float = 3e-3, **overrides) -> Path:
    """Train and save the learned tiny Llama (with tokenizer, chat template and ``learned.json``) into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.tiny import _llama_config, train_tokenizer

    out_dir = Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    texts = corpus_texts()
    tokenizer = train_tokenizer(staging, seed=seed, texts=[t for _, t in texts])
    config = _llama_config(len(tokenizer), **{"num_hidden_layers": 4, "dtype": "float32", **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rows = make_conversations(texts, conversations, seed)
    data = _batches(tokenizer, rows, seq_length, batch, random.Random(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, start = [], time.monotonic()
    model.train()
    while time.monotonic() - start < seconds or not losses:
        tokens, labels = next(data)
        loss = model(input_ids=tokens, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss))
    model.to(torch.bfloat16).save_pretrained(staging, safe_serialization=True)
    head = min(10, len(losses))
    write_json(staging / RECORD, {"steps": len(losses), "seconds": round(time.monotonic() - start, 1),
                                  "loss_first": sum(losses[:head]) / head, "loss_last": sum(losses[-head:]) / head,
                                  "corpus_files": len(texts), "packages": list(STDLIB_PACKAGES)})
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir
