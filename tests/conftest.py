"""Shared fixtures: tiny local models and prepared datasets, built once per test session."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# A test run started in the background by a shell without job control inherits SIGINT ignored, and so
# would every ops process the Ctrl-C tests start (an ignored signal stays ignored across exec): give
# Python's own handler back, so that those tests exercise ops, not how the run was launched.
signal.signal(signal.SIGINT, signal.default_int_handler)

# Property-based tests (hypothesis): 200 generated cases per test by default, what `make test` runs; `make
# fuzz` (mk/fuzz.mk) selects the larger profile by HYPOTHESIS_PROFILE. No example database: a shrunk failure
# is kept as a plain regression test instead. A test's own @settings(max_examples=...) still wins.
settings.register_profile(
    "default",
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
settings.register_profile("fuzz", parent=settings.get_profile("default"), max_examples=5000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Likewise a make that a test starts (the image tests read targets with `make -n`) must see what an
# operator's shell gives it: under `make test`, which runs suites with -j2, the outer make's jobserver and
# command-line variables would leak into it through these.
for _name in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"):
    os.environ.pop(_name, None)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's units: 64k, 1m) mounted on ``path`` (made here) for the block: a disk that
    fills up, or an output that is a mount point. Root only (CI runs as root)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def run_pipeline(
    *args: str,
    check: bool = False,
    timeout: float = 600,
    env: dict | None = None,
    cold: bool = False,
    **kwargs,
) -> subprocess.CompletedProcess:
    """Run ``python -m pipeline ARGS`` as an operator would (this environment, ``env`` over it); return the
    completed process. The command is a child forked from the session's warm server (tests/warm_cli.py:
    the same exit code, stdout and stderr, without ~3-4 s of torch's and transformers' imports). The server
    holds torch and transformers but never vLLM (no command's module imports it at import time), so a
    vLLM command's child imports vLLM and starts its engine as a cold run does. ``cold`` (a test of the
    interpreter itself: its import log), or any ``subprocess.run`` keyword (``input``), starts a new
    interpreter instead."""
    if not cold and not kwargs:
        warm = _warm_server()
        if warm.lock.acquire(blocking=False):  # one command at a time: a second one at once starts cold
            try:
                return warm.run(*args, check=check, timeout=timeout, env=env)
            finally:
                warm.lock.release()
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    proc = subprocess.run(
        [PYTHON, "-m", "pipeline", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
        **kwargs,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"pipeline {args[0]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


_WARM = []


def _warm_server():
    """The session's warm server (tests/warm_cli.py), started on first use, closed at the session's end."""
    if not _WARM:
        from tests.warm_cli import WarmPipeline

        _WARM.append(WarmPipeline(PYTHON))
    return _WARM[0]


def pytest_sessionfinish(session, exitstatus):
    while _WARM:
        _WARM.pop().close()


def run_extract(prepared, model, out, *more, **kwargs) -> subprocess.CompletedProcess:
    """``pipeline extract --prepared PREPARED --model MODEL --out OUT MORE...`` through run_pipeline."""
    return run_pipeline("extract", "--prepared", prepared, "--model", model, "--out", out, *more, **kwargs)


@pytest.fixture(scope="session")
def warm_pipeline():
    """`run_pipeline` answered by the session's warm server (tests/warm_cli.py) in either environment."""
    return _warm_server().run


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    """A tiny random Llama and synthetic conversations (assets/model, assets/conversations.jsonl)."""
    from pipeline.demo.tiny import build_tiny_model, write_conversations

    out = tmp_path_factory.mktemp("assets-llama")
    build_tiny_model("llama", out / "model")
    write_conversations(out / "conversations.jsonl", n=60)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tiny_assets) -> Path:
    return tiny_assets / "model"


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory) -> Path:
    from pipeline.demo.tiny import build_tiny_model

    return build_tiny_model("deepseek_v3", tmp_path_factory.mktemp("assets-dsv3") / "model")


@pytest.fixture(scope="session")
def conversations(tiny_assets) -> Path:
    return tiny_assets / "conversations.jsonl"


@pytest.fixture(scope="session")
def prepared_llama(tmp_path_factory, tiny_llama, conversations) -> Path:
    """60 prepared samples of at most 127 tokens, draft vocab 128."""
    out = tmp_path_factory.mktemp("prepared") / "prepared"
    run_pipeline(
        "prepare",
        "--data",
        conversations,
        "--model",
        tiny_llama,
        "--out",
        out,
        "--seq-length",
        128,
        "--draft-vocab-size",
        128,
        check=True,
    )
    return out


@pytest.fixture(scope="session")
def extracted_llama(tmp_path_factory, tiny_llama, prepared_llama) -> Path:
    """Hidden states of the first 24 prepared samples (fp32, CPU)."""
    out = tmp_path_factory.mktemp("states") / "states"
    run_extract(
        prepared_llama,
        tiny_llama,
        out,
        "--limit",
        24,
        "--no-progress",
        check=True,
    )
    return out
