"""The extract loop measures how long the device was busy and reports the fraction it sat idle."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from pipeline.backends.base import DeviceClock
from pipeline.extract.loop import FileRate, device_idle, first_batch_after
from tests.conftest import run_pipeline


def test_device_idle_fraction_is_busy_time_over_wall_time_per_device():
    """Idle = 1 - busy / (wall x devices), never negative, 0 for an empty run."""
    assert device_idle(3.0, 4.0) == {"device_busy_seconds": 3.0, "device_idle_fraction": pytest.approx(0.25)}
    assert device_idle(6.0, 4.0, devices=2)["device_idle_fraction"] == pytest.approx(0.25)
    assert device_idle(5.0, 4.0)["device_idle_fraction"] == 0.0
    assert device_idle(0.0, 0.0)["device_idle_fraction"] == 0.0


def test_cpu_clock_sums_only_the_started_intervals():
    """On the CPU the clock adds the wall time between start and stop, not the time between intervals."""
    clock = DeviceClock(torch.device("cpu"))
    for _ in range(2):
        clock.start()
        time.sleep(0.05)
        clock.stop()
        clock.settle()
        time.sleep(0.2)  # host-only work: not device time
    assert 0.1 <= clock.seconds < 0.4


@pytest.mark.parametrize("workers", [1, 2])
def test_extract_reports_device_busy_time_and_idle_fraction(tmp_path, tiny_llama, prepared_llama, workers):
    """A real run (one process or two workers) reports busy seconds within its wall time, its threads' CPU
    seconds, and prints the idle share."""
    argv = [
        "extract",
        "--prepared",
        prepared_llama,
        "--model",
        tiny_llama,
        "--limit",
        8,
        "--max-batch-size",
        2,
        "--no-progress",
        "--no-verify",
        "--data-parallel",
        workers,
    ]
    stats = json.loads(
        run_pipeline(*argv, "--out", tmp_path / "j", "--json-stats", check=True).stdout.splitlines()[-1]
    )
    assert 0 < stats["device_busy_seconds"] <= stats["seconds"] * workers
    assert 0 <= stats["device_idle_fraction"] < 1
    # each loop's thread times: the main thread's CPU within its loop's wall time, the writers' above zero
    for loop in stats["workers"] if workers > 1 else [stats]:
        assert 0 < loop["main_thread_cpu_seconds"] <= loop["seconds"] + 0.02  # the clock's tick
        assert 0 < loop["writer_cpu_seconds"]
        assert "forward_queue_seconds" in loop["backend"] and "pinned_pool" not in loop["backend"]  # the CPU
    printed = run_pipeline(*argv, "--out", tmp_path / "p", check=True).stdout
    assert "device idle" in printed and "%" in printed.split("device idle")[1]


def test_process_age_counts_from_the_process_start():
    """A process that sleeps 0.6 s before asking is at least that old, and younger than the test's wait for
    it."""
    code = "import time; time.sleep(0.6); from pipeline.extract.loop import process_age; print(process_age())"
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 0.6 <= float(out) <= time.perf_counter() - t0 + 0.02  # /proc's clock ticks are 10 ms


def test_launcher_progress_counts_this_hosts_files_and_rates_them_from_the_first_new_one():
    """Files of other hosts' shards do not count; resumed files count as done but not in tok/s; the rate
    starts at the first new file, so the workers' start-up does not dilute it."""
    rate = FileRate(owned={0, 2, 4, 6}, done={0}, lengths=[10, 11, 20, 21, 30, 31, 40])
    assert rate.update([0, 1], now=5.0) == (1, 0.0)  # only the resumed file, and host 1's data_1
    assert rate.update([0, 1, 2, 3], now=7.0) == (2, 0.0)  # the first new file: no interval yet
    assert rate.update([0, 1, 2, 3, 4, 6], now=9.0) == (4, pytest.approx((30 + 40) / 2.0))


def test_first_batch_after_leaves_out_workers_without_a_batch_and_unknown_ages():
    """The slowest worker that ran a batch sets the figure; a worker with nothing to do does not hide it."""
    ran = {"startup": {"imports_seconds": 1.0, "model_load_seconds": 4.0, "loop_start_seconds": 5.5}}
    idle = {"startup": {"imports_seconds": 1.2}}
    assert first_batch_after({"startup": {"workers_started_seconds": 2.0}, "workers": [ran, idle]}) == (
        7.5,
        4.0,
    )
    assert first_batch_after({"startup": {"workers_started_seconds": 2.0}, "workers": [idle]}) is None
    assert first_batch_after({"startup": {"workers_started_seconds": None}, "workers": [ran]}) is None
    assert first_batch_after({"startup": {"imports_seconds": 1.0}}) is None  # resumed with nothing left to do


@pytest.mark.parametrize("workers", [1, 2])
def test_extract_reports_where_its_start_up_went(tmp_path, tiny_llama, prepared_llama, workers):
    """The stats give, in process-age seconds, the end of the imports, the model load (and its parts) and the
    first batch (for two workers: when the launcher started them, and each worker's own timeline); the printed
    line sums it up."""
    argv = [
        "extract",
        "--prepared",
        prepared_llama,
        "--model",
        tiny_llama,
        "--limit",
        8,
        "--max-batch-size",
        2,
        "--no-progress",
        "--no-verify",
        "--data-parallel",
        workers,
    ]
    t0 = time.perf_counter()
    stats = json.loads(
        run_pipeline(*argv, "--out", tmp_path / "j", "--json-stats", check=True).stdout.splitlines()[-1]
    )
    wall = time.perf_counter() - t0
    own = stats["startup"]
    timelines = [w["startup"] for w in stats["workers"]] if workers > 1 else [own]
    if workers > 1:
        # the run's figures are a single process's: the slowest worker's loop; the start-up is reported apart
        assert stats["seconds"] == max(w["seconds"] for w in stats["workers"]) < stats["wall_seconds"] < wall
        assert stats["tokens_per_s"] == pytest.approx(stats["tokens"] / stats["seconds"])
        assert 0 < own["imports_seconds"] <= own["workers_started_seconds"] < wall
        assert "model_load_seconds" not in own  # the launcher loads no model
    for t in timelines:
        assert 0 < t["imports_seconds"] and 0 < t["model_load_seconds"]
        assert t["imports_seconds"] + t["model_load_seconds"] <= t["loop_start_seconds"] + 0.02
        # the load's parts, each measured inside it; the CUDA init is a GPU's only: absent, not 0, on the CPU
        parts = [t[f"{k}_seconds"] for k in ("transformers_import", "model_read", "model_to_device")]
        assert all(p >= 0 for p in parts) and t["model_read_seconds"] > 0
        assert sum(parts) <= t["model_load_seconds"]
        assert "cuda_init_seconds" not in t
        assert own.get("workers_started_seconds", 0) + t["loop_start_seconds"] < wall
    first, load = first_batch_after(stats)
    assert first == pytest.approx(
        max(own.get("workers_started_seconds", 0) + t["loop_start_seconds"] for t in timelines)
    )
    assert (
        load == max(timelines, key=lambda t: t["loop_start_seconds"])["model_load_seconds"]
    )  # the slowest one's
    printed = run_pipeline(*argv, "--out", tmp_path / "p", check=True).stdout
    assert re.search(r"first batch \d+\.\d s after start, model load \d+\.\d s\)", printed)
