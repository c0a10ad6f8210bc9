"""pipeline/backends/vllm_feed.py and vllm_scratch.py without vLLM: the engine thread keeps later batches
queued behind running ones and fails every waiter when the engine fails; the scratch folder of a live run is
never removed, a dead run's is (real processes holding real flocks). The real engine runs in tests/vllm."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from pipeline.backends import vllm_scratch
from pipeline.backends.vllm_feed import EngineFeed, external_id


class FakeEngine:
    """An offline engine: each step finishes at most ``per_step`` requests, oldest first; records which
    requests were waiting at each step."""

    def __init__(self, per_step: int = 2, fail_at_step: int | None = None):
        self.queue: list[tuple[str, object]] = []
        self.counter = itertools.count()
        self.per_step, self.fail_at_step = per_step, fail_at_step
        self.waiting_at_step: list[set] = []  # the prompts waiting when each step ran
        self.steps = 0
        self.gate = threading.Event()  # the first step waits for it
        self.llm_engine = self

    def enqueue(self, prompts, params, use_tqdm=False):
        ids = []
        for p in prompts:
            external = str(next(self.counter))
            self.queue.append((external, p))
            ids.append(f"{external}-abcdefgh")  # vLLM 0.32's internal id: the caller's id plus 8 characters
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.queue)

    def step(self):
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("EngineCore died")
        self.gate.wait(10)
        self.waiting_at_step.append({p for _, p in self.queue})
        done, self.queue = self.queue[: self.per_step], self.queue[self.per_step :]
        return [SimpleNamespace(request_id=rid, finished=True, prompt=p) for rid, p in done]


def test_results_come_back_per_prompt_and_later_batches_wait_behind_running_ones():
    """Each future resolves with its own prompt's output; a batch submitted while the engine still runs the
    first one joins the same queue (a step sees requests of both), so the engine never drains between them."""
    engine = FakeEngine(per_step=2)
    feed = EngineFeed(engine, params=None)
    try:
        first = feed.submit(["a", "b", "c", "d", "e", "f"])
        second = feed.submit(["g", "h"])
        engine.gate.set()  # the first batch is running (or about to) and the second is submitted
        assert [f.result(timeout=10).prompt for f in first + second] == list("abcdefgh")
    finally:
        feed.close()
    assert any({"e", "g"} <= waiting for waiting in engine.waiting_at_step), engine.waiting_at_step


class InProcessEngine(FakeEngine):
    """An engine core in this process whose connector still has copies to make for ``copies_left`` steps
    after the last request finished (vLLM copies a finished request's states on the step after)."""

    def __init__(self, copies_left: int):
        super().__init__(per_step=8)
        self.gate.set()
        self.copies_left = copies_left
        self.engine_core = SimpleNamespace(
            engine_core=SimpleNamespace(scheduler=SimpleNamespace(has_requests=self.has_requests))
        )

    def has_requests(self) -> bool:
        return bool(self.queue) or self.copies_left > 0

    def step(self):
        if not self.queue and self.copies_left:
            self.copies_left -= 1
            self.steps += 1
            return []
        return super().step()


def test_an_in_process_engine_is_stepped_until_its_connector_is_done():
    """With the engine core in this process nothing else steps it: after the last result the feed keeps
    stepping while the core still holds requests (the connector's copies), then waits idle."""
    engine = InProcessEngine(copies_left=3)
    feed = EngineFeed(engine, params=None)
    try:
        assert [f.result(timeout=10).prompt for f in feed.submit(["a", "b"])] == ["a", "b"]
        for _ in range(200):
            if engine.copies_left == 0:
                break
            threading.Event().wait(0.01)
        assert engine.copies_left == 0
        steps = engine.steps
        threading.Event().wait(0.05)
        assert engine.steps == steps  # no work left: the feed blocks instead of spinning
    finally:
        feed.close()


def test_an_engine_failure_fails_every_waiter_and_every_later_batch():
    """The engine's own error reaches the futures already handed out and the next submit; nothing hangs."""
    engine = FakeEngine(per_step=1, fail_at_step=2)
    engine.gate.set()
    feed = EngineFeed(engine, params=None)
    try:
        futures = feed.submit(["a", "b", "c"])
        assert futures[0].result(timeout=10).prompt == "a"
        for f in futures[1:]:
            with pytest.raises(RuntimeError, match="EngineCore died"):
                f.result(timeout=10)
        with pytest.raises(RuntimeError, match="EngineCore died"):
            feed.submit(["d"])
    finally:
        feed.close()


def test_external_ids_follow_vllms_randomised_request_ids():
    assert external_id("12-a1b2c3d4") == "12"
    assert external_id("12") == "12"  # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
    assert external_id("batch-7") == "batch-7"  # not one of the LLM's integer ids: as given


HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def test_a_live_runs_scratch_stays_and_a_dead_runs_goes(tmp_path):
    """remove_orphans takes a folder whose owner lock nobody holds (its process was killed) and leaves one
    whose lock a live process holds, also when that process is not ours (another container's)."""
    live, dead = tmp_path / ".vllm-states-live", tmp_path / ".vllm-states-dead"
    for d in (live, dead):
        d.mkdir()
        (d / "0.safetensors").write_bytes(b"x")
    holders = [
        subprocess.Popen([sys.executable, "-c", HOLD, str(d / vllm_scratch.LOCK)], stdout=subprocess.PIPE)
        for d in (live, dead)
    ]
    try:
        for h in holders:
            assert h.stdout.readline().strip() == b"locked"
        holders[1].kill()
        holders[1].wait()
        removed = vllm_scratch.remove_orphans(tmp_path, vllm_scratch.PREFIX)
        assert removed == [dead] and not dead.exists() and (live / "0.safetensors").exists()
    finally:
        for h in holders:
            h.kill()
            h.wait()


def test_scratch_goes_to_shared_memory_only_with_room(tmp_path):
    """/dev/shm when it has twice what can be in flight, else the output folder, each with its reason."""
    out = tmp_path / "out"
    assert vllm_scratch.choose(out, need=1 << 20, shm=tmp_path).root == tmp_path
    far_too_much = vllm_scratch.choose(out, need=1 << 60, shm=tmp_path)
    assert far_too_much.root == out and "under twice" in far_too_much.reason
    assert vllm_scratch.choose(out, need=1, shm=tmp_path / "missing").root == out


def test_a_scratch_folder_is_locked_while_its_backend_lives(tmp_path):
    """A Scratch holds its lock: another process's cleanup leaves it; after close() it is gone."""
    scratch = vllm_scratch.Scratch(tmp_path)
    try:
        code = (
            "import sys; from pathlib import Path; from pipeline.backends import vllm_scratch as s;"
            "print(len(s.remove_orphans(Path(sys.argv[1]), s.PREFIX)))"
        )
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
        assert out.stdout.strip() == "0", out.stderr
        assert scratch.path.is_dir()
    finally:
        scratch.close()
    assert not scratch.path.exists()
