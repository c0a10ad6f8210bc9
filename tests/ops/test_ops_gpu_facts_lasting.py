"""Issue #50 item 3: a GPU fact source that is not there at all (a `table:` file that does not exist,
NVML that cannot load) is refused at the first read, in one line with the unreadable-GPU-facts exit code
(6), however long the clean timeout; nothing is stopped or signalled. A table that reads half-written is
still retried (control). Real processes: ops as the operator runs it, a pid-file server, host `local`."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ops_helpers import REPO, run_ops, write_hosts
from ops_procs import alive

LONG = {"grace": 1, "kill_wait": 2, "stop": 5, "clean": 600}  # a wait for busy GPUs would last 10 minutes


def _local_host(tmp_path, devdir, gpu_source: str, **extra):
    return write_hosts(
        tmp_path / "hosts.toml",
        "here",
        host="local",
        python="/usr/bin/python3",
        device_glob=f"{devdir}/nvidia*",
        gpu_source=gpu_source,
        lock_file=str(tmp_path / "eagle-ops.lock"),
        **extra,
    )


def _sources(tmp_path) -> dict[str, tuple[str, str]]:
    """gpu_source -> what the one line must name."""
    missing = tmp_path / "no-such-table.json"
    return {"table-missing": (f"table:{missing}", str(missing)), "nvml": ("nvml", "NVML init failed")}


@pytest.mark.parametrize("source", ["table-missing", "nvml"])
def test_gpu_clean_refuses_a_missing_gpu_fact_source_at_once(tmp_path, devdir, procs, source):
    """gpu-clean with a 600 s clean timeout and a missing GPU fact source: one line `cannot read the GPU facts
    of here: ...`, exit 6, within seconds; the pid-file server is neither stopped nor signalled (before: the
    server stopped, then the whole clean timeout spent retrying, then a "not clean" report)."""
    if source == "nvml" and os.path.exists("/dev/nvidiactl"):
        pytest.fail("this machine has an NVIDIA driver: the NVML case needs one without")
    gpu_source, named = _sources(tmp_path)[source]
    pidfile = tmp_path / "server.pid"
    api, engine = procs.server(pidfile, [devdir / "nvidia0"])
    hosts = _local_host(tmp_path, devdir, gpu_source, server=f"pidfile:{pidfile}", timeouts=LONG)
    started = time.monotonic()
    res = run_ops("gpu-clean", "--host", "here", "--hosts-file", str(hosts), timeout=120)
    took = time.monotonic() - started
    err = res.stderr.strip()
    assert res.returncode == 6, res.stdout + res.stderr
    assert err.startswith("error: cannot read the GPU facts of here: ") and "\n" not in err, err
    assert named in err and "nothing was stopped or signalled" in err, err
    assert took < 60, f"gpu-clean took {took:.0f} s: it waited on a source that cannot come"
    assert alive(api.pid) and alive(engine), "the server was stopped although no GPU fact could be read"


def test_a_remote_run_refuses_a_missing_gpu_table_with_the_gpu_facts_code(tmp_path, devdir):
    """remote-extract on a host whose GPU table does not exist: exit 6 (the GPU facts' code, not the generic
    preflight 4) in one line naming the table, within seconds of a 600 s clean timeout, nothing started."""
    data = tmp_path / "data"
    (data / "prepared").mkdir(parents=True)
    gpu_source, named = _sources(tmp_path)["table-missing"]
    hosts = _local_host(
        tmp_path, devdir, gpu_source, data_root=str(data), model_dir=str(tmp_path), timeouts=LONG
    )
    started = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "ops", "remote-extract", "--host", "here", "--hosts-file", str(hosts),
         "--runs-dir", str(tmp_path / "runs")],
        cwd=REPO, capture_output=True, text=True, env=dict(os.environ, COLUMNS="200"), timeout=120,
    )  # fmt: skip
    took = time.monotonic() - started
    err = res.stderr.strip()
    assert res.returncode == 6, res.stdout + res.stderr
    assert err.startswith("error: cannot read the GPU facts of here: ") and "\n" not in err, err
    assert named in err and "nothing was stopped or started" in err, err
    assert took < 60, took


def test_a_half_written_table_is_still_waited_for(tmp_path, devdir):
    """Control: a table that exists but does not parse (one being rewritten) is not a missing source:
    gpu-clean retries it for the clean timeout (3 s here), then reports the GPUs not proven clean, exit 6."""
    table = tmp_path / "gpus.json"
    table.write_text('{"gpus": [')
    hosts = _local_host(
        tmp_path, devdir, f"table:{table}", timeouts={"grace": 1, "kill_wait": 2, "stop": 5, "clean": 3}
    )
    started = time.monotonic()
    res = run_ops("gpu-clean", "--host", "here", "--hosts-file", str(hosts), timeout=120)
    assert res.returncode == 6, res.stdout + res.stderr
    assert "cannot read GPUs" in res.stdout and time.monotonic() - started >= 3, res.stdout + res.stderr
