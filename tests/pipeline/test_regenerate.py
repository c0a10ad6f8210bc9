"""pipeline regenerate against a scripted OpenAI-compatible server (tests/pipeline/fake_openai.py): which
rows are kept, which are rejected and why, retries, a server that vanishes mid-run, a killed run continued,
and every bad input refused in one line with nothing that looks complete. The same stage against a real
`vllm serve` is tests/vllm/test_regenerate_vllm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.errors import CheckFailed, StageError
from pipeline.regenerate.config import RegenerateConfig
from pipeline.regenerate.journal import CONVERSATIONS, JOURNAL, SUMMARY
from pipeline.regenerate.replies import REASONS, Answer, Rejected, judge
from pipeline.regenerate.stage import run
from tests.conftest import REPO, run_pipeline
from tests.pipeline.fake_openai import FakeServer, completion, echo


def write_rows(path: Path, n: int, *, turns: int = 1, ids: bool = True) -> Path:
    with open(path, "w") as fh:
        for i in range(n):
            messages = [{"role": "system", "content": "be brief"}]
            for t in range(turns):
                messages += [
                    {"role": "user", "content": f"question {i}.{t}"},
                    {"role": "assistant", "content": f"someone else's answer {i}.{t}"},
                ]
            messages.append({"role": "user", "content": "a trailing turn with no answer"})
            fh.write(
                json.dumps({"id": f"r{i}", "messages": messages} if ids else {"messages": messages}) + "\n"
            )
    return path


def config(data: Path, out: Path, server: FakeServer, **kw) -> RegenerateConfig:
    return RegenerateConfig(
        data=data,
        out=out,
        endpoint=server.url,
        retries=kw.pop("retries", 1),
        progress_every=kw.pop("progress_every", 60.0),
        **kw,
    )


def output_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / CONVERSATIONS).read_text().splitlines()]


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def test_the_last_turn_is_regenerated_in_input_order_and_prepare_reads_it(tmp_path, server, tiny_llama):
    data = write_rows(tmp_path / "in.jsonl", 12, turns=2)
    summary = run(config(data, tmp_path / "out", server, concurrency=4))
    rows = output_rows(tmp_path / "out")
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(12)]
    for i, row in enumerate(rows):
        # the conversation up to its last assistant turn; that turn is the server's, the earlier one kept
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "user", "assistant"]
        assert row["messages"][2]["content"] == f"someone else's answer {i}.0"
        assert row["messages"][4]["content"] == f"answer to 'question {i}.1' after 4 turns"
    assert summary["kept"] == 12 and summary["rejected"] == 0 and summary["completion_tokens"] == 12 * 7
    assert len(server.chats()) == 12
    prepared = run_pipeline(
        "prepare",
        "--data",
        tmp_path / "out" / CONVERSATIONS,
        "--model",
        tiny_llama,
        "--out",
        tmp_path / "prep",
        check=True,
    )
    assert "prepared 12 samples" in prepared.stdout


def test_all_turns_are_asked_in_order_each_with_the_regenerated_turns_before_it(tmp_path, server):
    data = write_rows(tmp_path / "in.jsonl", 3, turns=3)
    run(config(data, tmp_path / "out", server, turns="all", concurrency=2))
    for i, row in enumerate(output_rows(tmp_path / "out")):
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert answers == [f"answer to 'question {i}.{t}' after {2 + 2 * t} turns" for t in range(3)]
    asked = [b["messages"] for b in server.chats() if b["messages"][1]["content"] == "question 1.0"]
    assert len(asked) == 3
    assert asked[2][2]["content"] == "answer to 'question 1.0' after 2 turns"  # not someone else's


BAD = {
    "r1": (200, completion("cut", finish="length", tokens=64)),
    "r2": (400, b'{"error": {"message": "This model\'s maximum context length is 256 tokens"}}'),
    "r3": (200, b'{"choices": [{"message": '),
    "r4": (200, json.dumps({"model": "fake", "choices": []}).encode()),
    "r5": (200, completion("hi", model="another")),
    "r6": (200, completion(None)),
    "r7": (200, completion("x", finish="abort")),
}
WHY = {
    "r1": "truncated",
    "r2": "refused",
    "r3": "malformed",
    "r4": "malformed",
    "r5": "wrong_model",
    "r6": "empty",
    "r7": "unfinished",
}


def scripted(body: dict) -> tuple[int, bytes]:
    question = body["messages"][-1]["content"]
    row = "r" + question.split()[1].split(".")[0] if question.startswith("question") else ""
    return BAD.get(row) or echo(body)


def test_every_rejected_row_is_counted_by_reason_and_never_kept(tmp_path):
    server = FakeServer(scripted)
    try:
        data = write_rows(tmp_path / "in.jsonl", 10)
        with pytest.raises(CheckFailed, match=r"7 of 10 rows rejected .*see .*rejected.jsonl"):
            run(config(data, tmp_path / "out", server))
        kept = [r["id"] for r in output_rows(tmp_path / "out")]
        assert kept == ["r0", "r8", "r9"]
        rejected = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "out/rejected.jsonl").open()}
        assert {k: v["reason"] for k, v in rejected.items()} == WHY
        summary = json.loads((tmp_path / "out" / SUMMARY).read_text())
        assert summary["rejected_by_reason"] == {r: list(WHY.values()).count(r) for r in REASONS}
        assert "maximum context length" in rejected["r2"]["detail"]
        # under the threshold the same run is a success
        summary = run(config(data, tmp_path / "out2", server, max_rejected=0.7))
        assert summary["kept"] == 3
    finally:
        server.close()


def test_transient_statuses_are_asked_again(tmp_path):
    failures = {"n": 0}

    def flaky(body):
        if failures["n"] < 2 and body.get("max_tokens") != 1:
            failures["n"] += 1
            return 503, b'{"message": "busy"}'
        return echo(body)

    server = FakeServer(flaky)
    try:
        summary = run(
            config(write_rows(tmp_path / "in.jsonl", 2), tmp_path / "out", server, retries=3, concurrency=1)
        )
        assert summary["kept"] == 2 and failures["n"] == 2
    finally:
        server.close()


def _journal_ids(out: Path) -> list[str]:
    return [json.loads(x)["id"] for x in (out / JOURNAL).read_text().splitlines()]


def test_a_server_that_vanishes_stops_the_run_and_a_rerun_continues_without_loss_or_repeat(tmp_path):
    data = write_rows(tmp_path / "in.jsonl", 20)
    answered = {"n": 0}
    first = FakeServer()
    port = first.port

    def then_gone(body):
        answered["n"] += 1
        if answered["n"] == 8:  # the probe and 6 rows answered, then the server goes away for good
            threading_close(first)
        return echo(body)

    first.reply = then_gone
    proc = run_pipeline(
        "regenerate",
        "--data",
        data,
        "--out",
        tmp_path / "out",
        "--endpoint",
        first.url,
        "--retries",
        "1",
        "--concurrency",
        "1",
    )
    assert proc.returncode == 4, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "no server answers at" in lines[0] and "finished rows are kept" in lines[0]
    assert not (tmp_path / "out" / CONVERSATIONS).exists() and not (tmp_path / "out" / SUMMARY).exists()
    done = _journal_ids(tmp_path / "out")
    assert 6 <= len(done) <= 7 and done == [f"r{i}" for i in range(len(done))]
    before = (tmp_path / "out" / JOURNAL).read_text()
    second = FakeServer(port=port)
    try:
        proc = run_pipeline("regenerate", "--data", data, "--out", tmp_path / "out", "--endpoint", second.url)
        assert proc.returncode == 0, proc.stderr
        assert f"continuing {tmp_path / 'out'}: {len(done)} of 20 rows already done" in proc.stderr
        assert len(second.chats()) == 20 - len(done)
        assert [r["id"] for r in output_rows(tmp_path / "out")] == [f"r{i}" for i in range(20)]
        assert (tmp_path / "out" / JOURNAL).read_text().startswith(before)
        assert json.loads((tmp_path / "out" / SUMMARY).read_text())["resumed_rows"] == len(done)
    finally:
        second.close()


def threading_close(server: FakeServer) -> None:
    import threading

    threading.Thread(target=server.close, daemon=True).start()


def test_a_killed_run_continues_and_a_torn_journal_line_is_redone(tmp_path):
    def slow(body):
        time.sleep(0.15)
        return echo(body)

    server = FakeServer(slow)
    try:
        data = write_rows(tmp_path / "in.jsonl", 40, ids=False)
        out = tmp_path / "out"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        argv = [
            sys.executable,
            "-m",
            "pipeline",
            "regenerate",
            "--data",
            str(data),
            "--out",
            str(out),
            "--endpoint",
            server.url,
            "--concurrency",
            "2",
        ]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not (out / JOURNAL).exists() or len(_journal_ids(out)) < 5:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        done = _journal_ids(out)
        with open(out / JOURNAL, "a") as fh:  # what a kill in the middle of a write would leave
            fh.write('{"id": "line:40", "row": {"messa')
        proc = run_pipeline("regenerate", "--data", data, "--out", out, "--endpoint", server.url)
        assert proc.returncode == 0, proc.stderr
        ids = [r["id"] for r in output_rows(out)]
        assert ids == [f"line:{i}" for i in range(1, 41)]  # each row once, in input order
        assert set(_journal_ids(out)) == set(ids) and len(_journal_ids(out)) == 40
        assert f"{len(done)} of 40 rows already done" in proc.stderr
    finally:
        server.close()


def test_a_rerun_with_other_settings_or_into_a_finished_run_is_refused(tmp_path, server):
    data = write_rows(tmp_path / "in.jsonl", 2)
    run(config(data, tmp_path / "out", server))
    with pytest.raises(StageError, match="already holds a finished regenerate run: pass --overwrite"):
        run(config(data, tmp_path / "out", server))
    (tmp_path / "out" / SUMMARY).unlink()
    with pytest.raises(StageError, match=r"asked with other settings \(temperature\)"):
        run(config(data, tmp_path / "out", server, temperature=0.7))
    assert run(config(data, tmp_path / "out", server, temperature=0.7, overwrite=True))["kept"] == 2


def _one_line_refusal(proc, code: int, text: str, out: Path) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("error:") and text in errors[0], proc.stderr
    assert not (out / CONVERSATIONS).exists() and not (out / SUMMARY).exists()


def test_bad_inputs_and_bad_servers_are_refused_in_one_line(tmp_path, server):
    out = tmp_path / "out"
    good = write_rows(tmp_path / "in.jsonl", 2)
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "broken.jsonl").write_text(good.read_text() + '{"messages": [}\n')
    (tmp_path / "twice.jsonl").write_text(good.read_text() + good.read_text().splitlines()[0] + "\n")
    (tmp_path / "noans.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    cases = [
        (["--data", tmp_path / "empty.jsonl"], 2, "has no conversation rows"),
        (["--data", tmp_path / "broken.jsonl"], 2, "broken.jsonl:3: not valid JSON"),
        (["--data", tmp_path / "twice.jsonl"], 2, "row id 'r0' already used at line 1"),
        (["--data", tmp_path / "noans.jsonl"], 2, "conversation has no assistant turn"),
        (["--data", tmp_path / "missing.jsonl"], 2, "not found"),
        (["--data", good, "--served-model", "other"], 2, "serves ['fake'], not 'other'"),
        (["--data", good, "--sampling", "[1]"], 2, "--sampling must be a JSON object"),
        (["--data", good, "--sampling", '{"temperature": 1}'], 2, "--sampling sets temperature"),
    ]
    for args, code, text in cases:
        _one_line_refusal(
            run_pipeline("regenerate", *args, "--out", out, "--endpoint", server.url), code, text, out
        )
    html = FakeServer(lambda body: (404, b"<html>nope</html>"))
    html.models = ()
    try:
        _one_line_refusal(
            run_pipeline("regenerate", "--data", good, "--out", out, "--endpoint", html.url),
            2,
            "without an OpenAI model list",
            out,
        )
    finally:
        html.close()
    no_template = FakeServer(
        lambda b: (400, b'{"error": {"message": "the tokenizer does not define a chat template"}}')
    )
    try:
        _one_line_refusal(
            run_pipeline("regenerate", "--data", good, "--out", out, "--endpoint", no_template.url),
            2,
            "cannot render a chat for 'fake'",
            out,
        )
    finally:
        no_template.close()
    closed = FakeServer()
    url = closed.url
    closed.close()
    _one_line_refusal(
        run_pipeline("regenerate", "--data", good, "--out", out, "--endpoint", url, "--retries", "0"),
        4,
        "no server answers at",
        out,
    )


def test_the_reasoning_a_server_returns_is_kept_where_the_template_reads_it(tmp_path):
    server = FakeServer(lambda body: (200, completion("the answer", reasoning="first, think")))
    try:
        run(config(write_rows(tmp_path / "in.jsonl", 1), tmp_path / "out", server))
        turn = output_rows(tmp_path / "out")[0]["messages"][-1]
        assert turn == {"role": "assistant", "content": "the answer", "reasoning_content": "first, think"}
    finally:
        server.close()


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
CHOICE = st.fixed_dictionaries(
    {},
    optional={
        "message": st.fixed_dictionaries(
            {}, optional={"content": JSONISH, "reasoning": JSONISH, "tool_calls": JSONISH, "role": JSONISH}
        )
        | JSONISH,
        "finish_reason": st.sampled_from(["stop", "length", None, "abort", 3]),
    },
)
REPLY = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["fake", "other", None, 1]),
        "choices": st.lists(CHOICE | JSONISH, max_size=2) | JSONISH,
        "usage": st.fixed_dictionaries({}, optional={"completion_tokens": JSONISH}) | JSONISH,
    },
)


@given(
    status=st.sampled_from([200, 200, 200, 400, 404, 429, 500, 503]),
    reply=REPLY | JSONISH,
    cut=st.integers(min_value=0, max_value=400) | st.none(),
)
def test_any_server_reply_is_an_answer_or_a_named_rejection_never_a_traceback(status, reply, cut):
    body = json.dumps(reply).encode()
    body = body if cut is None else body[:cut]
    result = judge(status, body, "fake")
    assert isinstance(result, Answer | Rejected)
    if isinstance(result, Answer):  # only a whole answer: 200, our model, finished by the target itself
        choice = json.loads(body)["choices"][0]
        assert status == 200 and json.loads(body)["model"] == "fake" and choice["finish_reason"] == "stop"
        assert isinstance(result.content, str) and (
            result.content.strip() or result.reasoning or result.tool_calls
        )
    else:
        assert result.reason in REASONS


def test_check_alone_asks_no_row_writes_nothing_and_refuses_what_a_run_would(tmp_path, server):
    """`--check` (ops' preflight of regenerate): one `ok` line per check and exit 0, the server asked its
    model list and the one-token chat alone, no --out made; a down server, another model, a server without
    a chat template, a bad input and a finished --out each end with one `FAIL NAME:` line on stdout, the
    one-line error and the run's own exit code, with nothing written."""
    data = write_rows(tmp_path / "in.jsonl", 3)
    out = tmp_path / "out"
    proc = run_pipeline("regenerate", "--data", data, "--out", out, "--endpoint", server.url, "--check")
    assert proc.returncode == 0, proc.stderr
    names = [ln.split(":")[0] for ln in proc.stdout.splitlines()]
    assert names == ["ok   input", "ok   server", "ok   output"]
    assert "3 rows" in proc.stdout and "serves 'fake' and renders its chat" in proc.stdout
    assert not out.exists() and server.chats() == [] and len(server.requests) == 1
    closed = FakeServer()
    url = closed.url
    closed.close()
    no_template = FakeServer(
        lambda b: (400, b'{"error": {"message": "the tokenizer does not define a chat template"}}')
    )
    finished = tmp_path / "finished"
    run(config(data, finished, server))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in finished.iterdir())
    cases = [
        (["--endpoint", url], 4, "server", "no server answers at"),
        (["--endpoint", server.url, "--served-model", "other"], 2, "server", "serves ['fake'], not 'other'"),
        (["--endpoint", no_template.url], 2, "server", "cannot render a chat for 'fake'"),
        (["--endpoint", server.url, "--data", tmp_path / "none.jsonl"], 2, "input", "not found"),
        (["--endpoint", server.url, "--out", finished], 2, "output", "already holds a finished"),
    ]
    try:
        for args, code, name, text in cases:
            proc = run_pipeline("regenerate", "--data", data, "--out", out, *args, "--check")
            assert proc.returncode == code, (args, proc.stdout, proc.stderr)
            assert proc.stdout.splitlines()[-1].startswith(f"FAIL {name}: ") and text in proc.stdout, args
            _one_line_refusal(proc, code, text, out)
            assert not out.exists()
    finally:
        no_template.close()
    assert sorted((p.name, p.stat().st_mtime_ns) for p in finished.iterdir()) == before


ROW = st.fixed_dictionaries(
    {},
    optional={
        "id": JSONISH,
        "messages": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "role": st.sampled_from(["user", "assistant", "system", "tool", "x", 3]),
                    "content": JSONISH,
                },
            )
            | JSONISH,
            max_size=4,
        )
        | JSONISH,
        "conversations": JSONISH,
    },
)


@given(lines=st.lists(ROW.map(json.dumps) | st.text(max_size=20), min_size=0, max_size=4))
def test_any_input_file_of_regenerate_and_evaluate_is_read_or_refused_in_one_line(lines, tiny_llama):
    """The files the two newest stages read first, generated: regenerate's conversations and evaluate's
    prompts (rendered by the target's template). Each is read whole or refused with a StageError naming the
    file; never another exception."""
    import tempfile

    from pipeline.evaluate import EvaluateConfig, read_prompts
    from pipeline.regenerate.rows import read_conversations

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        path.write_text("\n".join(lines) + "\n")
        for read in (
            lambda: read_conversations(path)[0],
            lambda: read_prompts(
                EvaluateConfig(model=tiny_llama, draft=path, prompts=path, out=Path(tmp) / "o", num_prompts=8)
            ),
        ):
            try:
                got = read()
            except StageError as exc:
                assert "\n" not in str(exc) and str(path) in str(exc), str(exc)
            else:
                assert got and isinstance(got, list)


def test_a_local_server_that_dies_at_start_is_told_by_its_root_cause(tmp_path):
    """A real process standing in for `vllm serve` prints what vLLM prints when the GPU's memory is taken (the
    root cause, then the wrapper that points back at it) and exits: the error names the root cause, not the
    wrapper, and the log."""
    from pipeline.regenerate.endpoint import free_port, local_server

    script = (
        "import sys;"
        "print('(EngineCore pid=1) ERROR [core.py:1510] ValueError: Free memory on device cuda:0 "
        "(16.67/79.18 GiB) on startup is less than desired GPU memory utilization (0.5, 39.59 GiB).');"
        "print('RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}');"
        "sys.exit(1)"
    )
    log = tmp_path / "serve.log"
    with pytest.raises(StageError) as err, local_server([sys.executable, "-c", script], free_port(), log,
                                                         start_timeout=60):  # fmt: skip
        pass
    message = str(err.value)
    assert "exited (1) before it answered: ValueError: Free memory on device cuda:0" in message, message
    assert "Engine core initialization failed" not in message and str(log) in message
