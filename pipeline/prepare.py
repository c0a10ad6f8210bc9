"""The ``prepare`` stage: conversations in, tokenized samples with assistant-only loss masks out.

Owns reading conversation rows (OpenAI ``messages`` or ShareGPT ``conversations``), deriving the loss
mask from the target's own chat template, truncation, and producing the token frequencies and the draft
vocabulary mapping. File layouts belong to pipeline/formats.py.

The loss mask comes from the chat template itself: for each assistant turn i, the text rendered for
``messages[:i]`` with the generation prompt is a prefix of the text for ``messages[:i+1]``; the characters
in between are the assistant's, and a token is masked in when its first character lies there. Templates
that rewrite earlier turns (so that the prefix property fails) are rejected with a clear error.

Samples are truncated to ``seq_length - 1`` tokens: vLLM needs prompt length < max_model_len to run
the prefill that captures the states, and both backends must see identical samples.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from pipeline import formats, readers
from pipeline.errors import StageError, require_range
from pipeline.modeldir import read_model_dir
from pipeline.outdir import staged_dir
from pipeline.vocab import build_vocab_mapping, token_frequencies

ROLE_ALIASES = {
    "system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
    "chatgpt": "assistant", "model": "assistant", "bing": "assistant", "bard": "assistant",
}
MAX_ROW_BYTES = 16 * 1024 * 1024
MAX_SEQ_LENGTH = 1 << 20  # longer than any model's context: a typo


@dataclass(frozen=True)
class PrepareConfig:
    """Options of the prepare stage."""

    data: Path  # JSONL file of conversations
    model: Path  # local model directory with tokenizer + chat template
    out: Path  # output directory (must be empty unless overwrite)
    seq_length: int = 2048  # samples keep at most seq_length - 1 tokens
    draft_vocab_size: int | None = None  # write d2t.npy / t2d.npy for this draft vocab
    overwrite: bool = False  # replace an existing output directory (token_freq.pt included)
    max_samples: int | None = None  # stop after this many kept samples
    skip_invalid: bool = False  # skip malformed rows (counted) instead of stopping at the first
    mask_check_rows: int = 64  # if none of the first N rows yields an assistant token, stop
    trust_remote_code: bool = False


def normalize_row(row: object) -> list[dict]:
    """Return OpenAI-style messages for a row, or raise ValueError saying what is wrong."""
    if not isinstance(row, dict):
        raise ValueError("row is not a JSON object")
    if "messages" in row:
        turns, role_key, text_key = row["messages"], "role", "content"
    elif "conversations" in row:
        turns, role_key, text_key = row["conversations"], "from", "value"
    else:
        raise ValueError("row has neither 'messages' nor 'conversations'")
    if not isinstance(turns, list) or not turns:
        raise ValueError("conversation is empty")
    messages = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise ValueError(f"turn {j} lacks '{role_key}' or '{text_key}'")
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise ValueError(f"turn {j} has unknown role {turn[role_key]!r}")
        if not isinstance(turn[text_key], str):
            raise ValueError(f"turn {j} content is not a string")
        messages.append({"role": role, "content": turn[text_key]})
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("conversation has no assistant turn")
    return messages


def read_rows(path: Path, *, skip_invalid: bool) -> Iterator[tuple[int, list[dict] | None]]:
    """Yield (line number, messages); messages is None for a skipped invalid row."""
    if not path.is_file():
        raise StageError(f"data file {path} not found (pass --data FILE.jsonl)")
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                if len(raw) > MAX_ROW_BYTES:
                    raise ValueError(f"row is {len(raw)} bytes, over the {MAX_ROW_BYTES}-byte limit")
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ValueError(f"invalid UTF-8 at byte {exc.start}") from None
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"not valid JSON ({exc.msg})") from None
                yield lineno, normalize_row(row)
            except ValueError as exc:
                if not skip_invalid:
                    raise StageError(f"{path}:{lineno}: {exc} (fix the row or pass --skip-invalid)") from None
                yield lineno, None


class TemplateMasker:
    """Tokenizes a conversation and marks the assistant tokens, using the tokenizer's chat template."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise StageError("the tokenizer has no chat template: add chat_template.jinja to the model dir")
        if not getattr(tokenizer, "is_fast", False):
            raise StageError("a fast tokenizer (tokenizer.json) is needed for character offsets")
        self.tokenizer = tokenizer

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], generation_prompt=True) if i else ""
            upto = self.render(messages[: i + 1])
            if not (full.startswith(upto) and upto.startswith(before)):
                raise StageError(
                    "the chat template rewrites earlier turns, so assistant spans cannot be derived from it "
                    "(prefix property fails); use a template that renders turns append-only"
                )
            spans.append((len(before), len(upto)))
        return full, spans

    def __call__(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        text, spans = self.assistant_spans(messages)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, mask = enc["input_ids"], []
        starts = np.array([s for s, _ in spans] or [0])
        ends = np.array([e for _, e in spans] or [0])
        for start, end in enc["offset_mapping"]:
            inside = bool(np.any((starts <= start) & (start < ends))) if end > start else False
            mask.append(1 if inside else 0)
        return ids, mask


def load_tokenizer(model_dir: Path, trust_remote_code: bool):
    return readers.load_tokenizer(model_dir, trust_remote_code)


def run(cfg: PrepareConfig) -> formats.PreparedMetadata:
    require_range("--seq-length", cfg.seq_length, 2, MAX_SEQ_LENGTH)
    require_range("--max-samples", cfg.max_samples, 1)
    model = read_model_dir(cfg.model)
    if cfg.draft_vocab_size is not None and not 0 < cfg.draft_vocab_size <= model.vocab_size:
        raise StageError(f"--draft-vocab-size {cfg.draft_vocab_size} must be between 1 and the target vocab size {model.vocab_size}")
    masker = TemplateMasker(load_tokenizer(cfg.model, cfg.trust_remote_code))
    max_tokens = cfg.seq_length - 1
    rows, skipped, truncated, no_loss, seen = [], 0, 0, 0, 0
    for lineno, messages in read_rows(cfg.data, skip_invalid=cfg.skip_invalid):
        if messages is None:
            skipped += 1
            continue
        seen += 1
        ids, mask = masker(messages)
        if len(ids) > max_tokens:
            ids, mask = ids[:max_tokens], mask[:max_tokens]
            truncated += 1
        if max(ids, default=0) >= model.vocab_size:
            raise StageError(f"{cfg.data}:{lineno}: token id {max(ids)} >= model vocab size {model.vocab_size}: tokenizer and config.json disagree")
        if sum(mask) == 0:
            no_loss += 1
        else:
            rows.append((ids, mask))
        if seen == cfg.mask_check_rows and not rows:
            raise StageError(
                f"none of the first {seen} rows has an assistant token after masking: the chat template "
                "does not mark assistant turns as this stage expects; nothing to train on"
            )
        if cfg.max_samples is not None and len(rows) >= cfg.max_samples:
            break
    if not rows:
        raise StageError(f"no usable samples in {cfg.data} ({seen} rows read, {skipped} invalid, {no_loss} without assistant tokens)")
    samples = formats.PreparedSamples.from_rows(rows)
    freq = token_frequencies(samples.tokens, samples.loss_mask)
    metadata = formats.PreparedMetadata(
        model=str(cfg.model.resolve()), seq_length=cfg.seq_length, max_tokens=max_tokens,
        num_samples=len(samples), num_tokens=int(samples.offsets[-1]), num_loss_tokens=int(samples.loss_mask.sum()),
        target_vocab_size=model.vocab_size, draft_vocab_size=cfg.draft_vocab_size, source=str(cfg.data.resolve()),
        mask_method="chat-template-prefix", skipped_rows=skipped, truncated_rows=truncated,
        extra={"rows_without_assistant_tokens": no_loss},
    )
    with staged_dir(cfg.out, overwrite=cfg.overwrite, inputs={"--data": cfg.data, "--model": cfg.model}) as staging:
        formats.write_token_freq(staging / formats.TOKEN_FREQ, freq)
        if cfg.draft_vocab_size is not None:
            d2t, t2d = build_vocab_mapping(freq, model.vocab_size, cfg.draft_vocab_size)
            formats.write_vocab(staging, d2t, t2d)
        formats.write_prepared(staging, samples, metadata)
    return metadata


@click.command("prepare")
@click.option("--data", type=click.Path(path_type=Path), required=True, help="Conversations, one JSON object per line.")
@click.option("--model", type=click.Path(path_type=Path), required=True, help="Target model dir (tokenizer + chat template + config.json).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Output directory.")
@click.option("--seq-length", type=int, default=2048, show_default=True, help="Samples keep at most seq_length - 1 tokens.")
@click.option("--draft-vocab-size", type=int, default=None, help="Also write d2t.npy/t2d.npy for this draft vocab size.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory (token_freq.pt included).")
@click.option("--max-samples", type=int, default=None, help="Keep at most this many samples.")
@click.option("--skip-invalid", is_flag=True, help="Skip malformed rows (counted in metadata.json) instead of stopping.")
@click.option("--trust-remote-code", is_flag=True, help="Allow the tokenizer's own Python code (e.g. Kimi-K2.5).")
def command(**kwargs) -> None:
    """Tokenize conversations with the target's chat template; loss mask on assistant tokens only."""
    meta = run(PrepareConfig(**kwargs))
    click.echo(
        f"prepared {meta.num_samples} samples, {meta.num_tokens} tokens ({meta.num_loss_tokens} assistant) "
        f"-> {kwargs['out']}  [skipped {meta.skipped_rows} invalid, truncated {meta.truncated_rows}]"
    )
