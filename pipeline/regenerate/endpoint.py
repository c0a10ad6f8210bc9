"""The OpenAI-compatible chat endpoint ``regenerate`` talks to: its checks before any row, one chat request
with its retries, and the local ``vllm serve`` this stage starts where no server runs.

Owns the HTTP side (httpx): what the base URL is (``http://host:port`` or ``.../v1``), the checks that refuse
a server before any row is asked (nothing answers; not OpenAI-compatible; it serves another model; it cannot
render a chat because the model has no chat template), and the retries: a request that fails in transport
(refused connection, timeout) or with a transient status (408, 429, 5xx) is asked again after 1, 2, 4, ... s
up to ``retries`` times. A server still unreachable after that raises ``EndpointDown``: the stage stops, its
finished rows kept, and a re-run continues. A reply's judgement belongs to replies.py.

``local_server`` starts ``vllm serve`` of a model folder on a free port of 127.0.0.1 in its own process group
(the CPU build's settings where no GPU is visible: pipeline/runtime/vllm_cpu.py), waits until it answers, and
ends the whole group when the run ends, however it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import StageError
from pipeline.regenerate.replies import Answer, Rejected, judge
from pipeline.runtime.vllm_log import root_cause

SERVED_NAME = "target"  # the name a local server serves the model under


class EndpointDown(StageError):
    """The server stopped answering mid-run: the finished rows are kept and a re-run continues."""

    exit_code = 4


def base_url(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` (a trailing slash either way) -> ``.../v1``."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise StageError(f"--endpoint {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000/v1)")
    return url if url.endswith("/v1") else url + "/v1"


class Endpoint:
    """One server's chat API, for one model name."""

    def __init__(self, url: str, model: str | None, *, timeout: float, retries: int, concurrency: int = 1):
        import httpx

        self.url = base_url(url)
        self.model = model
        self.retries = retries
        limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
        self._client = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits)
        self._transport_errors = (httpx.TransportError,)

    def close(self) -> None:
        self._client.close()

    def _unreachable(self, exc: BaseException) -> StageError:
        return EndpointDown(
            f"no server answers at {self.url} ({type(exc).__name__}: {exc}): start it (or check --endpoint), "
            "then re-run: finished rows are kept"
        )

    def served_models(self) -> list[str]:
        """The model ids ``GET /v1/models`` lists; refused in one line when nothing OpenAI-compatible
        answers."""
        try:
            resp = self._client.get(self.url + "/models")
        except self._transport_errors as exc:
            raise self._unreachable(exc) from None
        try:
            data = resp.json()["data"] if resp.status_code == 200 else None
            ids = [m["id"] for m in data] if isinstance(data, list) else None
        except (ValueError, KeyError, TypeError):
            ids = None
        if not ids or not all(isinstance(i, str) for i in ids):
            raise StageError(
                f"{self.url}/models answered HTTP {resp.status_code} without an OpenAI model list: "
                "point --endpoint at an OpenAI-compatible server (vllm serve)"
            )
        return ids

    def check(self, template_kwargs: dict | None = None) -> str:
        """Before any row: the server answers, serves our model (chosen when it serves one alone) and renders
        a chat. Returns the model name."""
        ids = self.served_models()
        if self.model is None:
            if len(ids) != 1:
                raise StageError(f"{self.url} serves {ids}: choose one with --served-model")
            self.model = ids[0]
        elif self.model not in ids:
            raise StageError(
                f"{self.url} serves {ids}, not {self.model!r}: check --served-model (or the hosts file's "
                "served_model) against the server"
            )
        probe = [{"role": "user", "content": "Hello"}]
        status, body = self._post(self._body(probe, max_tokens=1, template_kwargs=template_kwargs))
        reply = judge(status, body, self.model)
        if isinstance(reply, Rejected) and reply.reason in ("refused", "malformed", "wrong_model"):
            if "chat template" in reply.detail.lower() or "chat_template" in reply.detail.lower():
                raise StageError(
                    f"{self.url} cannot render a chat for {self.model!r} ({reply.detail}): serve a model "
                    "folder with a chat template, or pass the server --chat-template"
                )
            raise StageError(f"{self.url} refused a one-token chat for {self.model!r}: {reply.detail}")
        return self.model

    def _body(
        self, messages: list[dict], *, max_tokens: int, template_kwargs: dict | None, **sampling
    ) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, **sampling}
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        return body

    def _post(self, body: dict) -> tuple[int, bytes]:
        """POST a chat request, retrying transport errors and transient statuses."""
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        delay = 1.0
        for attempt in range(self.retries + 1):
            try:
                resp = self._client.post(self.url + "/chat/completions", content=data, headers=headers)
            except self._transport_errors as exc:
                if attempt == self.retries:
                    raise self._unreachable(exc) from None
            else:
                status = resp.status_code
                if status < 500 and status not in (408, 429) or attempt == self.retries:
                    return status, resp.content
            time.sleep(delay)
            delay = min(delay * 2, 16.0)
        raise AssertionError("unreachable")

    def chat(self, messages: list[dict], **sampling) -> Answer | Rejected:
        """The target's answer to ``messages`` (sampling: max_tokens, temperature, seed, ...)."""
        template_kwargs = sampling.pop("template_kwargs", None)
        max_tokens = sampling.pop("max_tokens")
        body = self._body(messages, max_tokens=max_tokens, template_kwargs=template_kwargs, **sampling)
        status, raw = self._post(body)
        return judge(status, raw, self.model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(
    model: Path,
    port: int,
    *,
    tensor_parallel_size: int,
    max_model_len: int | None,
    dtype: str,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """``vllm serve`` of ``model`` on 127.0.0.1:port, as this stage starts it."""
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--dtype",
        dtype,
    ]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    from pipeline.backends.base import visible_device_count

    if visible_device_count() == 0:
        from pipeline.runtime import vllm_cpu

        argv += ["--enforce-eager", *vllm_cpu.cli_arguments(dtype)]
    return argv + list(extra)


def _tail(path: Path, lines: int = 5) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    return "(no log)"


@contextlib.contextmanager
def local_server(argv: list[str], port: int, log: Path, *, start_timeout: float) -> Iterator[str]:
    """Run ``argv`` (a ``vllm serve``) until it answers on ``port``; yield its URL; end its process group."""
    import httpx

    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise StageError(
                    f"the local vllm serve exited ({proc.returncode}) before it answered: "
                    f"{root_cause(log.read_text(errors='replace'))[:400]} (whole log: {log})"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/models", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise StageError(
                    f"the local vllm serve did not answer within {start_timeout:.0f} s: {_tail(log)} "
                    f"(raise --server-start-timeout; whole log: {log})"
                )
            time.sleep(2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # the engine-core child outlives its parent's exit
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
