"""The options of `pipeline regenerate`; its command line is made from them (pipeline/options.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import StageError
from pipeline.options import opt, validate


@dataclass(frozen=True)
class RegenerateConfig:
    data: Path = opt(help="Conversations to regenerate, one JSON object per line (what prepare reads).")
    out: Path = opt(
        help="Output directory: conversations.jsonl (what prepare reads), rejected.jsonl, "
        "summary.json; a killed run's directory is continued."
    )
    endpoint: str | None = opt(
        None,
        help="The running server's OpenAI-compatible URL (http://HOST:PORT/v1); without it, a local "
        "`vllm serve` of --model is started on this host's GPUs and stopped at the end.",
    )
    served_model: str | None = opt(
        None, help="The model name the server serves the target under (default: the one it lists)."
    )
    model: Path | None = opt(None, help="Target model folder, for the local server (no --endpoint).")
    turns: str = opt(
        "last",
        choices=("last", "all"),
        help="Regenerate the last assistant turn of each "
        "row, or every assistant turn in order (each with the regenerated ones before it).",
    )
    max_tokens: int = opt(
        2048,
        low=1,
        high=1 << 20,
        help="Most tokens per answer; a longer answer is rejected as truncated, never kept.",
    )
    temperature: float = opt(0.0, low=0.0, high=10.0, help="Sampling temperature (0: greedy).")
    top_p: float = opt(1.0, low=0.0, high=1.0, low_open=True, help="Nucleus sampling's top_p.")
    seed: int = opt(
        0,
        low=0,
        high=2**31 - 1,
        help="Each row's seed is this plus a hash of its id: a "
        "resumed run asks a row exactly as the first run would have.",
    )
    concurrency: int = opt(16, low=1, high=4096, help="Requests in flight at once.")
    chat_template_kwargs: str | None = opt(
        None, help="JSON object handed to the chat template, e.g. '{\"enable_thinking\": true}'."
    )
    sampling: str | None = opt(
        None,
        help="JSON object of more request fields, merged into every chat request (vLLM's sampling "
        'parameters, e.g. \'{"top_k": 20, "min_p": 0}\', or logit_bias, stop).',
    )
    request_timeout: float = opt(600.0, low=1.0, high=86400.0, help="Seconds one request may take.")
    retries: int = opt(
        5,
        low=0,
        high=100,
        help="Retries of a request that fails in transport or with "
        "408/429/5xx (1, 2, 4 ... 16 s apart) before the run stops (finished rows kept).",
    )
    max_rejected: float = opt(
        0.05,
        low=0.0,
        high=1.0,
        help="Exit 3 when more than this share of rows is rejected (the outputs are written either way).",
    )
    skip_invalid: bool = opt(False, help="Skip malformed input rows (counted) instead of stopping.")
    overwrite: bool = opt(False, help="Start over: remove this stage's files in --out first.")
    check: bool = opt(
        False,
        help="Check only, then exit 0: read the input rows, judge --out (as the run would), ask the server "
        "whether it answers for the model with a chat template; no row is asked, nothing is written.",
    )
    tensor_parallel_size: int = opt(1, low=1, high=64, help="The local server's tensor parallel size.")
    dtype: str = opt("auto", help="The local server's --dtype.")
    max_model_len: int | None = opt(None, low=16, help="The local server's --max-model-len.")
    server_start_timeout: float = opt(1800.0, low=10.0, help="Seconds the local server may take to start.")
    progress_every: float = opt(10.0, low=0.1, help="Seconds between progress lines on stderr.")

    def __post_init__(self) -> None:
        validate(self)
        if self.endpoint is None and self.model is None:
            raise StageError("no --endpoint and no --model: name the running server, or the model to serve")
        self.template_kwargs()
        self.extra_sampling()

    def template_kwargs(self) -> dict | None:
        return _json_object("--chat-template-kwargs", self.chat_template_kwargs, '{"enable_thinking": true}')

    def extra_sampling(self) -> dict:
        extra = _json_object("--sampling", self.sampling, '{"top_k": 20}') or {}
        fixed = sorted(set(extra) & {"model", "messages", "max_tokens", "temperature", "top_p", "seed", "n"})
        if fixed:
            raise StageError(f"--sampling sets {', '.join(fixed)}: use their own options (or drop them)")
        return extra


def _json_object(flag: str, text: str | None, example: str) -> dict | None:
    """``text`` as a JSON object, refused in one line when it is not one."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise StageError(f"{flag} is not JSON ({exc}): pass an object, e.g. '{example}'") from None
    if not isinstance(value, dict):
        raise StageError(f"{flag} must be a JSON object, e.g. '{example}'")
    return value
