"""pipeline regenerate against a real `vllm serve` (vLLM 0.32.0 CPU build) of a tiny target with a thinking
chat template: the answers are the target's, the reasoning is kept where the template renders it, the server
killed mid-run and started again loses and repeats no row, a model without a chat template and a wrong model
name are refused before any row, and without --endpoint the stage serves the model itself and leaves no
process behind.

The tiny random target rarely ends a turn by chance, so every request carries a logit_bias (through
--sampling, as a user passes vLLM's sampling parameters) that makes `</think>` and the end-of-turn token
likely: answers of a few dozen tokens, some ending within --max-tokens and some cut by it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.regenerate.endpoint import free_port, serve_argv
from tests.conftest import run_pipeline

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

THINKING = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content "
    "is not none else '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0] %}"
    "{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<think>\\n' + reasoning + '</think>' + content"
    " + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<think>\\n' }}"
    "{%- endif %}"
)
GENERATION_PROMPT = "<|start_header_id|>assistant<|end_header_id|>\n\n<think>\n"
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def thinking_model(tiny_llama, tmp_path_factory) -> tuple[Path, dict]:
    """The tiny Llama with `</think>` as a token of its own and a Qwen3-style thinking template (the
    generation prompt opens the reasoning block; an earlier answer's `</think>` splits reasoning from
    content); the --sampling text that biases `</think>` and the end-of-turn token."""
    from transformers import AutoTokenizer

    model = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_llama, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_tokens(["</think>"])
    tok.chat_template = THINKING
    tok.save_pretrained(model)
    (model / "chat_template.jinja").write_text(THINKING)
    think, eot = tok.convert_tokens_to_ids("</think>"), tok.convert_tokens_to_ids("<|eot_id|>")
    assert think < json.loads((model / "config.json").read_text())["vocab_size"]
    return model, {"logit_bias": {str(think): 3.0, str(eot): 3.0}}


class Server:
    """`vllm serve` of a model on one port, started and killed (its whole process group) at will."""

    def __init__(self, model: Path, log: Path):
        self.model, self.log, self.port, self.proc = model, log, free_port(), None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        argv = serve_argv(self.model, self.port, tensor_parallel_size=1, max_model_len=512, dtype="float32")
        argv[argv.index("--served-model-name") + 1] = "tiny-thinker"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
            )
        import httpx

        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise AssertionError("vllm serve did not start: " + self.log.read_text()[-3000:])

    def kill(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


@pytest.fixture(scope="module")
def server(thinking_model, tmp_path_factory):
    s = Server(thinking_model[0], tmp_path_factory.mktemp("serve") / "serve.log")
    s.start()
    yield s
    s.kill()


def rows_file(conversations: Path, path: Path, n: int) -> Path:
    path.write_text("".join(conversations.read_text().splitlines(keepends=True)[:n]))
    return path


def regenerate(data: Path, out: Path, url: str, sampling: dict, *more: str, **kw):
    return run_pipeline(
        "regenerate", *sampled(data, sampling), "--out", out, "--endpoint", url, *more, env=ENV, **kw
    )


def sampled(data: Path, sampling: dict) -> tuple:
    """The input rows and the sampling every test asks with: the biased tokens, temperature 1, short answers,
    every rejection allowed."""
    return (
        "--data",
        data,
        "--sampling",
        json.dumps(sampling),
        "--temperature",
        "1.0",
        "--max-tokens",
        "48",
        "--max-rejected",
        "1",
    )


def test_answers_are_the_targets_and_the_template_renders_them_as_generated(
    server, thinking_model, conversations, tmp_path
):
    from transformers import AutoTokenizer

    from pipeline.prepare import normalize_row

    model, sampling = thinking_model
    data = rows_file(conversations, tmp_path / "in.jsonl", 16)
    proc = regenerate(data, tmp_path / "out", server.url, sampling, "--turns", "all", "--concurrency", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["served_model"] == "tiny-thinker" and summary["rows"] == 16
    assert summary["kept"] + summary["rejected"] == 16 and summary["kept"] >= 1
    assert set(k for k, v in summary["rejected_by_reason"].items() if v) <= {"truncated", "empty"}
    kept = [json.loads(x) for x in (tmp_path / "out" / "conversations.jsonl").read_text().splitlines()]
    rejected = [json.loads(x) for x in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert len(kept) == summary["kept"] and sorted(r["id"] for r in kept + rejected) == sorted(
        json.loads(x)["id"] for x in data.read_text().splitlines()
    )
    tok = AutoTokenizer.from_pretrained(model)
    originals = {json.loads(x)["id"]: json.loads(x) for x in data.read_text().splitlines()}
    thought = 0
    for row in kept:
        answers = [m for m in row["messages"] if m["role"] == "assistant"]
        before = [m for m in normalize_row(originals[row["id"]]) if m["role"] == "assistant"]
        assert len(answers) == len(before) and all(
            a["content"] != b["content"] for a, b in zip(answers, before)
        )
        # the rendered conversation ends with exactly what the target generated after its generation prompt
        # (where it closed its reasoning block once, as a thinking model does: a template like Qwen3's keeps
        # only what follows the last `</think>` as the content, so a random model's second one is dropped)
        text = tok.apply_chat_template(row["messages"], tokenize=False)
        last = answers[-1]["content"]
        if last.count("</think>") <= 1:
            assert text.endswith(
                GENERATION_PROMPT + (last if "</think>" in last else "</think>" + last) + "<|eot_id|>"
            )
            thought += "</think>" in last
    assert thought >= 1  # some answers closed a reasoning block, which the template keeps in place
    prepared = run_pipeline(
        "prepare",
        "--data",
        tmp_path / "out" / "conversations.jsonl",
        "--model",
        model,
        "--out",
        tmp_path / "prep",
    )
    assert prepared.returncode == 0 and f"prepared {len(kept)} samples" in prepared.stdout, prepared.stderr


def test_refused_before_any_row_a_wrong_model_name(server, thinking_model, conversations, tmp_path):
    data = rows_file(conversations, tmp_path / "in.jsonl", 2)
    proc = regenerate(data, tmp_path / "out", server.url, thinking_model[1], "--served-model", "kimi-k2.5")
    assert proc.returncode == 2 and "serves ['tiny-thinker'], not 'kimi-k2.5'" in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "journal.jsonl").exists()


def _journal(out: Path) -> list[str]:
    path = out / "journal.jsonl"
    return [json.loads(x)["id"] for x in path.read_text().splitlines()] if path.exists() else []


def test_the_server_killed_mid_run_then_restarted_loses_and_repeats_no_row(
    server, thinking_model, conversations, tmp_path
):
    data = rows_file(conversations, tmp_path / "in.jsonl", 40)
    out = tmp_path / "out"
    argv_more = ("--concurrency", "2", "--retries", "1")
    from tests.conftest import PYTHON, REPO

    cmd = [
        PYTHON,
        "-m",
        "pipeline",
        "regenerate",
        *map(str, sampled(data, thinking_model[1])),
        "--out",
        str(out),
        "--endpoint",
        server.url,
        *argv_more,
    ]
    run = subprocess.Popen(
        cmd, env={**ENV, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    while len(_journal(out)) < 4:
        assert time.monotonic() < deadline and run.poll() is None, run.communicate()
        time.sleep(0.2)
    server.kill()
    _, err = run.communicate(timeout=120)
    assert run.returncode == 4 and "no server answers at" in err, err
    done = _journal(out)
    assert 4 <= len(done) < 40 and not (out / "conversations.jsonl").exists()
    server.start()
    proc = regenerate(data, out, server.url, thinking_model[1], *argv_more)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{len(done)} of 40 rows already done" in proc.stderr
    final = _journal(out)
    assert final[: len(done)] == done and len(final) == len(set(final)) == 40
    kept = [json.loads(x)["id"] for x in (out / "conversations.jsonl").read_text().splitlines()]
    rejected = [json.loads(x)["id"] for x in (out / "rejected.jsonl").read_text().splitlines()]
    assert sorted(kept + rejected) == sorted(final)


def test_without_an_endpoint_the_stage_serves_the_model_itself(
    thinking_model, tiny_llama, conversations, tmp_path
):
    model, sampling = thinking_model
    data = rows_file(conversations, tmp_path / "in.jsonl", 3)
    common = (*sampled(data, sampling), "--dtype", "float32", "--max-model-len", "512")
    proc = run_pipeline("regenerate", *common, "--out", tmp_path / "out", "--model", model, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["endpoint"] == "local vllm serve" and summary["rows"] == 3
    left = subprocess.run(
        ["pgrep", "-f", f"serve {model} .*--served-model-name target"], capture_output=True, text=True
    ).stdout.split()
    assert not left, f"the local server's processes outlived the stage: {left}"
    # a model folder without a chat template: refused at the server check, before any row
    bare = tmp_path / "bare"
    shutil.copytree(tiny_llama, bare)
    (bare / "chat_template.jinja").unlink()
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    proc = run_pipeline("regenerate", *common, "--out", tmp_path / "out2", "--model", bare, env=ENV)
    assert proc.returncode == 2 and "cannot render a chat" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out2" / "journal.jsonl").exists()
