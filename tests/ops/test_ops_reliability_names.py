"""Host names and run ids cannot place a run record outside --runs-dir; timeouts that are NaN, infinite,
absurd or not positive are refused up front with the allowed range."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ops.errors import ConfigError
from ops.hosts import HostConfig, load_hosts_file

REPO = Path(__file__).resolve().parents[2]


def _hosts(path: Path, name: str, extra: str = "") -> Path:
    path.write_text(f'[hosts."{name}"]\nhost = "127.0.0.1"\n{extra}')
    return path


@pytest.mark.parametrize("name", ["../../outside", "..", "/etc/cron.d", "a/b", ".", "-rf"])
def test_hosts_file_names_that_are_not_one_folder_are_refused(tmp_path, name):
    """A [hosts."NAME"] that is a path, '.', '..' or starts with a dash is refused naming it."""
    with pytest.raises(ConfigError, match="host name .* must be 1-100 letters"):
        load_hosts_file(_hosts(tmp_path / "h.toml", name))


def test_ipv6_and_plain_names_still_make_run_folders(tmp_path):
    """Names a host may legitimately have (IPv6 address, dotted name) stay accepted."""
    from ops.runstate import run_dir

    assert run_dir(tmp_path, "::1", "extract-1") == tmp_path / "::1" / "extract-1"
    assert run_dir(tmp_path, "gpu-box.lan", "r.1") == tmp_path / "gpu-box.lan" / "r.1"


@pytest.mark.parametrize("run_id", ["..", ".", "../x", ".hidden", "-x"])
def test_run_ids_that_escape_or_hide_are_refused(run_id):
    """`--run-id ..` (accepted before) and other ids that are not one visible folder name are refused."""
    from ops.stage import check_run_id

    with pytest.raises(ConfigError, match="run id"):
        check_run_id(run_id)


@pytest.mark.parametrize("labels", [("..", "r"), ("box", ".."), ("a/../../b", "r")])
def test_local_run_dir_never_leaves_the_runs_dir(tmp_path, labels):
    """remote-run's local folder: a host name or run id that would leave --runs-dir is refused, nothing
    created."""
    from ops.remote_run import local_run_dir

    root = tmp_path / "runs"
    root.mkdir()
    with pytest.raises(ConfigError):
        local_run_dir(root, HostConfig(name=labels[0], host="h"), labels[1])
    assert sorted(tmp_path.rglob("*")) == [root]


def test_symlinked_run_folder_is_refused(tmp_path):
    """A host folder under runs/ that is a symlink elsewhere does not carry the record out of --runs-dir."""
    from ops.runstate import run_dir

    root = tmp_path / "runs"
    root.mkdir()
    (root / "box").symlink_to(tmp_path)
    with pytest.raises(ConfigError, match="outside --runs-dir"):
        run_dir(root, "box", "r1")


def test_fanout_previous_run_id_is_checked(tmp_path):
    """A multi-host --run-id is checked before its record is looked up outside the runs folder."""
    from ops.fanout import find_previous

    with pytest.raises(ConfigError):
        find_previous(tmp_path, "..", "extract", ["a", "b"])


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e12", "0", "-5"])
def test_non_finite_or_absurd_timeouts_are_refused(tmp_path, value):
    """timeouts.NAME = nan/inf/1e12/0/-5 in the hosts file: refused naming it and the allowed range."""
    with pytest.raises(
        ConfigError, match=r"timeouts\.clean must be a positive number of seconds up to 604800"
    ):
        load_hosts_file(_hosts(tmp_path / "h.toml", "box", f"[hosts.box.timeouts]\nclean = {value}\n"))


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_wait_flag_must_be_finite(value):
    """`gpu-clean --wait nan|inf|-1` (a real ops process) is one line, exit 2, before any connection."""
    proc = subprocess.run(
        [sys.executable, "-m", "ops", "gpu-clean", "--host", "local", "--wait", value],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    err = proc.stderr.strip()
    assert (
        proc.returncode == 2 and "\n" not in err and "--wait must be a positive number of seconds" in err
    ), err
