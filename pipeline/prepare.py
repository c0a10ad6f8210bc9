"""The ``prepare`` stage: conversations in, tokenized samples with assistant-only loss masks out.

Owns reading conversation rows (OpenAI ``messages`` or ShareGPT ``conversations``), deriving the loss
mask from the target's own chat template, truncation, and producing the token frequencies and the draft
vocabulary mapping. File layouts belong to pipeline/ondisk/formats.py.

The loss mask comes from the chat template itself, applied to the whole conversation once: the sample is
that rendering, so templates that rewrite earlier turns (Qwen3- and Kimi-K2.5-style thinking templates drop
the reasoning of turns before the last user message) are trained on exactly as they render them. For each
assistant turn, the masker finds its span in the rendered text:

* where it starts: right after the template's generation prompt (the text ``add_generation_prompt`` adds
  after ``messages[:i]``, e.g. ``<|im_start|>assistant\n``), the last one before the first character that
  depends on the turn's content (found by rendering the conversation again with that turn's content replaced
  by a probe character and diffing the two texts);
* where it ends: with the template's end-of-turn token (the special token the template writes right after
  an assistant's content, e.g. ``<|im_end|>``, ``<|eot_id|>``), the first one after the turn's content.

"Exactly the assistant tokens" therefore means: every token whose first character lies between the end of
the generation prompt and the end of the end-of-turn token: the reasoning block when the template keeps it
(its ``<think>`` tags included), the content, rendered tool calls, and the end-of-turn token itself (the
model must learn to stop); not the header, and not what the template writes after the end-of-turn token
(the newline after ``<|im_end|>``: serving stops at the end-of-turn token and never generates it). A
template without an end-of-turn special token ends the span with the turn's content.

Rows may carry ``reasoning_content`` (or ``reasoning``) on assistant turns, ``tool_calls`` on assistant
turns and ``tool`` turns (OpenAI form), handed to the template as they are; a row with tool calls is
refused with one line when the template does not render them (training on a conversation whose tool calls
silently vanished would teach the draft text the target never saw).

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

from pipeline.ondisk import formats, provenance, readers
from pipeline.errors import StageError
from pipeline.model.modeldir import read_model_dir
from pipeline.options import opt, options, validate
from pipeline.ondisk.outdir import staged_dir
from pipeline.model.vocab import build_vocab_mapping, token_frequencies

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "tool": "tool",
}
PROBE = "\ue000"  # a private-use character: replaces a turn's content to find which characters depend on it
MAX_ROW_BYTES = 16 * 1024 * 1024
MAX_SEQ_LENGTH = 1 << 20  # longer than any model's context: a typo


@dataclass(frozen=True)
class PrepareConfig:
    """Options of the prepare stage (the command line is made from these fields: pipeline/options.py)."""

    data: Path = opt(help="Conversations, one JSON object per line.")
    model: Path = opt(help="Target model dir (tokenizer + chat template + config.json).")
    out: Path = opt(help="Output directory.")  # must be empty unless overwrite
    seq_length: int = opt(
        2048, low=2, high=MAX_SEQ_LENGTH, help="Samples keep at most seq_length - 1 tokens."
    )
    # checked against the target's vocab size in run(): it needs the model
    draft_vocab_size: int | None = opt(None, help="Also write d2t.npy/t2d.npy for this draft vocab size.")
    overwrite: bool = opt(False, help="Replace an existing output directory (token_freq.pt included).")
    max_samples: int | None = opt(None, help="Keep at most this many samples.", low=1)
    skip_invalid: bool = opt(
        False, help="Skip malformed rows (counted in metadata.json) instead of stopping."
    )
    mask_check_rows: int = opt(
        64, cli=False, help="If none of the first N rows yields an assistant token, stop."
    )
    trust_remote_code: bool = opt(False, help="Allow the tokenizer's own Python code (e.g. Kimi-K2.5).")

    def __post_init__(self) -> None:
        validate(self)


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
    field = "messages" if role_key == "role" else "conversations"
    if not isinstance(turns, list):
        raise ValueError(f"'{field}' is a JSON {json_kind(turns)}, expected a list of turns")
    if not turns:
        raise ValueError("conversation is empty")
    messages = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise ValueError(f"turn {j} lacks '{role_key}' or '{text_key}'")
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise ValueError(f"turn {j} has unknown role {turn[role_key]!r}")
        messages.append(_message(j, role, turn, text_key))
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("conversation has no assistant turn")
    refuse_unencodable(messages)
    return messages


def json_kind(value: object) -> str:
    """The JSON name of a decoded value's kind (`string`, `object`, ...)."""
    kinds = ((bool, "boolean"), (int, "number"), (float, "number"), (str, "string"), (dict, "object"))
    return "null" if value is None else next((name for t, name in kinds if isinstance(value, t)), "array")


def refuse_unencodable(messages: list[dict]) -> None:
    """Refuse text that no encoder takes: a lone UTF-16 surrogate (JSON's ``\\ud800`` without its pair)
    decodes to a Python string the tokenizer, and any UTF-8 writer, cannot carry. Every string the chat
    template may see is checked, wherever in the turn it is."""
    try:
        json.dumps(messages, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        for j, turn in enumerate(messages):
            try:
                json.dumps(turn, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                break
        else:
            j = 0
        bad = exc.object[exc.start : exc.end]
        raise ValueError(
            f"turn {j} holds {ascii(bad)}, a lone UTF-16 surrogate that no text encoding can carry "
            "(a \\uD800-\\uDFFF escape without its pair)"
        ) from None


def _message(j: int, role: str, turn: dict, text_key: str) -> dict:
    """One turn as the template receives it: role and content, and the reasoning and tool fields it may
    use."""
    content = turn[text_key]
    calls = turn.get("tool_calls")
    if content is None and role == "assistant" and calls:
        content = ""
    if not isinstance(content, str):
        raise ValueError(f"turn {j} content is not a string")
    if PROBE in content:
        raise ValueError(f"turn {j} contains U+E000, which the loss masking reserves")
    message = {"role": role, "content": content}
    reasoning = turn.get("reasoning_content", turn.get("reasoning"))
    if reasoning is not None:
        if role != "assistant" or not isinstance(reasoning, str):
            raise ValueError(f"turn {j} has reasoning_content that is not an assistant turn's string")
        message["reasoning_content"] = reasoning
    if calls is not None:
        if (
            role != "assistant"
            or not isinstance(calls, list)
            or not all(
                isinstance(c, dict)
                and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                for c in calls
            )
        ):
            raise ValueError(
                f"turn {j} tool_calls must be an assistant turn's list of "
                f"{{'function': {{'name', 'arguments'}}}}"
            )
        message["tool_calls"] = calls
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(turn.get(key), str):
                message[key] = turn[key]
    return message


def parse_line(raw: bytes) -> object:
    """One line of a conversations file as JSON, or ValueError saying why it is not."""
    if len(raw) > MAX_ROW_BYTES:
        raise ValueError(f"row is {len(raw)} bytes, over the {MAX_ROW_BYTES}-byte limit")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"invalid UTF-8 at byte {exc.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None


def read_rows(path: Path, *, skip_invalid: bool) -> Iterator[tuple[int, list[dict] | None]]:
    """Yield (line number, messages); messages is None for a skipped invalid row."""
    if not path.is_file():
        raise StageError(f"data file {path} not found (pass --data FILE.jsonl)")
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                yield lineno, normalize_row(parse_line(raw))
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
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except TemplateError as exc:
            raise ValueError(
                "the chat template fails on this row: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from None

    def end_of_turn(self) -> str:
        """The special token the template writes right after an assistant's content ("" if none)."""
        if not hasattr(self, "_eot"):
            text = self.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": PROBE}])
            tail = text[text.rindex(PROBE) + 1 :] if PROBE in text else ""
            enc = (
                self.tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True) if tail else None
            )
            special = set(self.tokenizer.all_special_ids) | {
                i
                for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items()
                if getattr(t, "special", False)
            }
            first = enc["input_ids"][0] if enc and enc["input_ids"] else None
            self._eot = (
                tail[slice(*enc["offset_mapping"][0])]
                if first in special and enc["offset_mapping"][0][0] == 0
                else ""
            )
        return self._eot

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and each assistant turn's character span in it (module docstring)."""
        full = self.render(messages)
        eot = self.end_of_turn()
        spans: list[tuple[int, int]] = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            probe = [
                *messages[:i],
                {k: v for k, v in m.items() if k != "reasoning_content"} | {"content": PROBE},
                *messages[i + 1 :],
            ]
            other = self.render(probe)
            first = _common_prefix(full, other)
            content_end = len(full) - _common_suffix(full[first:], other[first:])
            start = self._turn_start(messages, i, full, first)
            end = full.find(eot, content_end) + len(eot) if eot else content_end
            if start < (spans[-1][1] if spans else 0) or (eot and end < len(eot)):
                raise StageError(
                    f"cannot find assistant turn {i} in the rendered conversation: the chat template "
                    f"does not write the generation prompt before it or {eot or 'an end'} after it"
                )
            spans.append((start, end))
        return full, spans

    def _turn_start(self, messages: list[dict], i: int, full: str, first: int) -> int:
        """Right after the last generation prompt before character ``first`` (0 for a conversation that opens
        with the assistant)."""
        if i == 0:
            return 0
        prompt = self.render(messages[:i], generation_prompt=True)
        plain = self.render(messages[:i])
        header = prompt[len(plain) :] if prompt.startswith(plain) else ""
        if not header:
            return first
        at = full.rfind(header, 0, first)  # the last occurrence that ends at or before ``first``
        if at < 0:
            raise StageError(
                f"the chat template's generation prompt {header!r} does not precede assistant turn {i}"
            )
        return at + len(header)

    def refuse_unrendered_tools(self, messages: list[dict]) -> None:
        """One line if the template drops a row's tool calls (or tool turns) instead of rendering them."""
        if not any("tool_calls" in m for m in messages):
            return
        bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
        if self.render(bare) == self.render(messages):
            raise ValueError(
                "row has tool_calls, but the chat template does not render them: tool-call rows are "
                "supported only with a template that writes tool calls"
            )

    def __call__(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        self.refuse_unrendered_tools(messages)
        text, spans = self.assistant_spans(messages)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, mask = enc["input_ids"], []
        starts = np.array([s for s, _ in spans] or [0])
        ends = np.array([e for _, e in spans] or [0])
        for start, end in enc["offset_mapping"]:
            inside = bool(np.any((starts <= start) & (start < ends))) if end > start else False
            mask.append(1 if inside else 0)
        return ids, mask


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _common_suffix(a: str, b: str) -> int:
    return _common_prefix(a[::-1], b[::-1])


def load_tokenizer(model_dir: Path, trust_remote_code: bool):
    return readers.load_tokenizer(model_dir, trust_remote_code)


def run(cfg: PrepareConfig) -> formats.PreparedMetadata:
    model = read_model_dir(cfg.model)
    if cfg.draft_vocab_size is not None and not 0 < cfg.draft_vocab_size <= model.vocab_size:
        raise StageError(
            f"--draft-vocab-size {cfg.draft_vocab_size} must be between 1 "
            f"and the target vocab size {model.vocab_size}"
        )
    masker = TemplateMasker(load_tokenizer(cfg.model, cfg.trust_remote_code))
    max_tokens = cfg.seq_length - 1
    rows, skipped, truncated, no_loss, seen = [], 0, 0, 0, 0
    for lineno, messages in read_rows(cfg.data, skip_invalid=cfg.skip_invalid):
        if messages is None:
            skipped += 1
            continue
        seen += 1
        try:
            ids, mask = masker(messages)
        except ValueError as exc:
            if not cfg.skip_invalid:
                raise StageError(
                    f"{cfg.data}:{lineno}: {exc} (drop the row or pass --skip-invalid)"
                ) from None
            skipped += 1
            continue
        if len(ids) > max_tokens:
            ids, mask = ids[:max_tokens], mask[:max_tokens]
            truncated += 1
        if max(ids, default=0) >= model.vocab_size:
            raise StageError(
                f"{cfg.data}:{lineno}: token id {max(ids)} >= model vocab size {model.vocab_size}: "
                "tokenizer and config.json disagree"
            )
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
        raise StageError(
            f"no usable samples in {cfg.data} "
            f"({seen} rows read, {skipped} invalid, {no_loss} without assistant tokens)"
        )
    samples = formats.PreparedSamples.from_rows(rows)
    freq = token_frequencies(samples.tokens, samples.loss_mask)
    metadata = formats.PreparedMetadata(
        model=str(cfg.model.resolve()),
        seq_length=cfg.seq_length,
        max_tokens=max_tokens,
        num_samples=len(samples),
        num_tokens=int(samples.offsets[-1]),
        num_loss_tokens=int(samples.loss_mask.sum()),
        target_vocab_size=model.vocab_size,
        draft_vocab_size=cfg.draft_vocab_size,
        source=str(cfg.data.resolve()),
        mask_method="chat-template-render-spans",
        skipped_rows=skipped,
        truncated_rows=truncated,
        extra={"rows_without_assistant_tokens": no_loss},
        provenance=provenance.record("prepare"),
    )
    with staged_dir(
        cfg.out, overwrite=cfg.overwrite, inputs={"--data": cfg.data, "--model": cfg.model}
    ) as staging:
        formats.write_token_freq(staging / formats.TOKEN_FREQ, freq)
        if cfg.draft_vocab_size is not None:
            d2t, t2d = build_vocab_mapping(freq, model.vocab_size, cfg.draft_vocab_size)
            formats.write_vocab(staging, d2t, t2d)
        formats.write_prepared(staging, samples, metadata)
    return metadata


@click.command("prepare")
@options(PrepareConfig)
def command(**kwargs) -> None:
    """Tokenize conversations with the target's chat template; loss mask on assistant tokens only."""
    meta = run(PrepareConfig(**kwargs))
    click.echo(
        f"prepared {meta.num_samples} samples, {meta.num_tokens} tokens ({meta.num_loss_tokens} assistant) "
        f"-> {kwargs['out']}  [skipped {meta.skipped_rows} invalid, truncated {meta.truncated_rows}]"
    )
