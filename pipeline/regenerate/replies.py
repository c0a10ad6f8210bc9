"""What one answer of an OpenAI-compatible chat endpoint is: a whole assistant turn, or a rejected row.

Owns the judgement of a reply, from its HTTP status and raw body, with no I/O: the one place that decides
whether the target's answer is kept. A row is kept only when the server answered 200 with a JSON body naming
the expected model, one choice whose ``finish_reason`` is ``stop`` (the target ended its turn itself) and a
message whose content (or reasoning) is text. Everything else is a ``Rejected`` with a reason from
``REASONS``, counted and listed by the stage, never dropped silently or kept as if whole: a truncated answer
(``finish_reason: length``) would teach the draft to stop mid-sentence.

``transient`` replies (a 5xx, 408 or 429) may be asked again; the rest are final for the row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# why a row was not kept: reason -> what it means (the summary and rejected.jsonl use these names)
REASONS = {
    "refused": "the server answered with an HTTP error status (4xx, or 5xx after the retries)",
    "truncated": "finish_reason 'length': the answer hit --max-tokens or the context",
    "unfinished": "a finish_reason other than 'stop' (or none)",
    "malformed": "the body is not the JSON of a chat completion (no choices, no message, wrong types)",
    "empty": "the answer has neither content nor reasoning nor tool calls",
    "wrong_model": "the reply names another model than the one asked for",
    "no_prompt": "the assistant turn has no turn before it to answer",
}
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
DETAIL_CHARS = 200


@dataclass(frozen=True)
class Answer:
    """A whole assistant turn, as prepare reads it."""

    content: str
    reasoning: str | None = None
    tool_calls: list | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0

    def message(self) -> dict:
        message: dict = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


@dataclass(frozen=True)
class Rejected:
    """A reply that is not a whole answer: ``reason`` (a key of REASONS) and a short detail."""

    reason: str
    detail: str = ""
    transient: bool = False
    completion_tokens: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        assert self.reason in REASONS, self.reason


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 3] + "..."


def _server_message(body: bytes) -> str:
    """The error text of an error body (OpenAI's {"error": {"message"}} or vLLM's {"message"}), else the
    body's start."""
    try:
        obj = json.loads(body)
    except ValueError:
        return _short(body.decode("utf-8", "replace"))
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return _short(err["message"])
        if isinstance(err, str):
            return _short(err)
    return _short(json.dumps(obj)[:DETAIL_CHARS])


def _count(usage: object, key: str) -> int:
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def judge(status: int, body: bytes, model: str) -> Answer | Rejected:
    """The reply to one chat request for ``model``: an Answer, or why it is Rejected."""
    if status != 200:
        detail = f"HTTP {status}: {_server_message(body)}"
        return Rejected("refused", detail, transient=status in TRANSIENT_STATUS)
    try:
        obj = json.loads(body)
    except ValueError as exc:
        return Rejected("malformed", f"body is not JSON ({_short(str(exc))})")
    if not isinstance(obj, dict):
        return Rejected("malformed", "body is not a JSON object")
    if obj.get("model") != model:
        return Rejected(
            "wrong_model", f"reply is for model {_short(repr(obj.get('model')))}, asked {model!r}"
        )
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        return Rejected("malformed", "no choices")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        return Rejected("malformed", "the choice has no message object")
    tokens = _count(obj.get("usage"), "completion_tokens")
    finish = choice.get("finish_reason")
    if finish == "length":
        return Rejected("truncated", f"stopped after {tokens} tokens", completion_tokens=tokens)
    if finish != "stop":
        return Rejected("unfinished", f"finish_reason {_short(repr(finish))}", completion_tokens=tokens)
    content = message.get("content")
    reasoning = message.get("reasoning", message.get("reasoning_content"))
    calls = message.get("tool_calls")
    if content is not None and not isinstance(content, str):
        return Rejected("malformed", "message content is not a string")
    if reasoning is not None and not isinstance(reasoning, str):
        return Rejected("malformed", "message reasoning is not a string")
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        return Rejected("malformed", "tool_calls is not a list of objects")
    if not (content or "").strip() and not (reasoning or "").strip() and not calls:
        return Rejected("empty", "no content, reasoning or tool calls", completion_tokens=tokens)
    return Answer(
        content=content or "",
        reasoning=reasoning or None,
        tool_calls=calls or None,
        completion_tokens=tokens,
        prompt_tokens=_count(obj.get("usage"), "prompt_tokens"),
    )
