"""A scripted OpenAI-compatible chat server on 127.0.0.1 for regenerate's tests in the light environment.

A real HTTP server (http.server, threads); what it answers is the test's ``reply(body) -> (status, bytes)``.
It records every chat request's body. The real-server tests (a `vllm serve` of a tiny model) are in
tests/vllm/test_regenerate_vllm.py; these cover what a real server will not do on demand: a 503 then an
answer, a truncated or malformed body, a wrong model name, a server that vanishes after N answers.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Reply = Callable[[dict], tuple[int, bytes]]


def completion(
    content: str | None,
    *,
    model: str = "fake",
    finish: str | None = "stop",
    tokens: int = 7,
    reasoning: str | None = None,
) -> bytes:
    message: dict = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning"] = reasoning
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 11, "completion_tokens": tokens, "total_tokens": 11 + tokens},
    }
    return json.dumps(body).encode()


def echo(body: dict) -> tuple[int, bytes]:
    """The default answer: names the last user turn and how many turns it was asked with."""
    last = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
    return 200, completion(f"answer to {last!r} after {len(body['messages'])} turns")


class FakeServer:
    def __init__(self, reply: Reply = echo, models: tuple[str, ...] = ("fake",), port: int = 0):
        self.reply, self.models, self.requests = reply, models, []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": m} for m in outer.models]}).encode())
                else:
                    self._send(404, b"<html>not found</html>")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append(body)
                status, data = outer.reply(body)
                self._send(status, data)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def chats(self) -> list[dict]:
        """The chat requests of rows (the one-token probe of the server check left out)."""
        return [b for b in self.requests if b.get("max_tokens") != 1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
