"""The input of ``regenerate``: its conversation rows, their ids, and which assistant turns each one asks for.

Owns reading the conversations file (the rows ``prepare`` reads: OpenAI ``messages`` or ShareGPT
``conversations``, one JSON object per line), each row's id (its own ``id`` field where it has a string or
integer one, else ``line:N``; a repeated id is refused, since finished rows are keyed by it), and the plan of
a row, pure: which turns are asked for and how the answered row is put together. ``turns="last"`` asks for
the last assistant turn and keeps what comes before it; ``turns="all"`` asks for every assistant turn in
order, each with the regenerated turns before it as its context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import StageError
from pipeline.prepare import normalize_row, parse_line
from pipeline.regenerate.replies import Answer, Rejected


@dataclass(frozen=True)
class Row:
    """One conversation: its id, its line, its turns (OpenAI form) and the row's other top-level fields."""

    id: str
    line: int
    messages: list[dict]
    extra: dict


def _row_id(row: dict, line: int) -> str:
    value = row.get("id")
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return f"line:{line}"


def read_conversations(path: Path, *, skip_invalid: bool = False) -> tuple[list[Row], list[int]]:
    """The rows of ``path`` and the line numbers of invalid rows skipped (``skip_invalid``); a bad row
    otherwise, a missing or empty file, or a repeated id is refused in one line."""
    if not path.is_file():
        raise StageError(f"conversations file {path} not found (pass --data FILE.jsonl)")
    rows: list[Row] = []
    skipped: list[int] = []
    seen: dict[str, int] = {}
    with open(path, "rb") as fh:
        for line, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                obj = parse_line(raw)
                messages = normalize_row(obj)
            except ValueError as exc:
                if not skip_invalid:
                    raise StageError(f"{path}:{line}: {exc} (fix the row or pass --skip-invalid)") from None
                skipped.append(line)
                continue
            row_id = _row_id(obj, line)
            if row_id in seen:
                raise StageError(
                    f"{path}:{line}: row id {row_id!r} already used at line {seen[row_id]} "
                    "(ids key the finished rows: make them unique, or drop the id fields)"
                )
            seen[row_id] = line
            extra = {k: v for k, v in obj.items() if k not in ("messages", "conversations")}
            rows.append(Row(row_id, line, messages, extra))
    if not rows:
        what = "only invalid rows" if skipped else "no conversation rows"
        raise StageError(f"conversations file {path} has {what}: nothing to regenerate")
    return rows, skipped


def assistant_turns(messages: list[dict], turns: str) -> list[int]:
    """The indices of the assistant turns to ask for."""
    indices = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return indices if turns == "all" else indices[-1:]


Ask = Callable[[list[dict]], Answer | Rejected]


def regenerate_row(row: Row, turns: str, ask: Ask) -> tuple[dict | None, Rejected | None, int]:
    """Ask for the row's turns in order through ``ask`` (messages -> reply); the answered row (as prepare
    reads it) or the first rejection (its detail names the turn), and the completion tokens spent."""
    messages = [dict(m) for m in row.messages]
    spent = 0
    wanted = assistant_turns(messages, turns)
    for i in wanted:
        if i == 0:
            return None, Rejected("no_prompt", "turn 0 is an assistant turn with nothing before it"), spent
        reply = ask(messages[:i])
        spent += reply.completion_tokens
        if isinstance(reply, Rejected):
            detail = f"turn {i}: {reply.detail}" if len(wanted) > 1 else reply.detail
            return None, Rejected(reply.reason, detail, reply.transient, reply.completion_tokens), spent
        messages[i] = reply.message()
    return {**row.extra, "id": row.id, "messages": messages[: wanted[-1] + 1]}, None, spent
