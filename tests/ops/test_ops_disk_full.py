"""Issue #50 item 2, ops' half: a fetch into runs/ on a full laptop disk (a real 8 KiB tmpfs) is one line
that says "disk full" and names the local file, never taken for a host that wrote no summary; nothing
half-written is left. The file comes over a real SFTP session (the test sshd) and through LocalRunner."""

from __future__ import annotations

import pytest

from ops.connection import LocalRunner, RemoteRunner
from ops.errors import OpsError
from ops.hosts import load_hosts_file
from ops.localfile import fetch
from ops.runstate import write_json
from tests.conftest import tmpfs
from test_ops_server import hosts_for


def _runner(kind: str, tmp_path, request):
    if kind == "local":
        return LocalRunner()
    sshd, devdir = request.getfixturevalue("sshd"), request.getfixturevalue("devdir")
    return RemoteRunner(load_hosts_file(hosts_for(tmp_path, sshd, devdir, "none"))["box"])


@pytest.mark.parametrize("kind", ["local", pytest.param("ssh", marks=pytest.mark.sshd)])
def test_a_fetch_onto_a_full_disk_says_disk_full_and_names_the_file(tmp_path, request, kind):
    """summary.json (64 KiB on the host) fetched into an 8 KiB runs/ folder: OpsError `disk full: cannot
    write RUNS/summary.json: No space left on device (...)`, one line; no file and no temp file left (before:
    the error was swallowed and the run counted as one whose stage wrote no summary)."""
    remote = tmp_path / "host" / "summary.json"
    remote.parent.mkdir()
    remote.write_text('{"x": "' + "y" * 65536 + '"}')
    runner = _runner(kind, tmp_path, request)
    try:
        with tmpfs(tmp_path / "runs", "8k") as runs:
            with pytest.raises(OpsError) as info:
                fetch(runner, str(remote), runs / "summary.json")
            text = str(info.value)
            assert text.startswith(f"disk full: cannot write {runs / 'summary.json'}: "), text
            assert "No space left on device" in text and "\n" not in text, text
            assert list(runs.iterdir()) == []
    finally:
        runner.close()


@pytest.mark.parametrize("kind", ["local", pytest.param("ssh", marks=pytest.mark.sshd)])
def test_a_summary_the_host_does_not_have_is_not_an_error(tmp_path, request, kind):
    """Control: a stage that wrote no summary: fetch says so (False), leaves nothing, raises nothing; a file
    that is there arrives whole."""
    runner = _runner(kind, tmp_path, request)
    try:
        local = tmp_path / "runs" / "summary.json"
        local.parent.mkdir()
        assert fetch(runner, str(tmp_path / "no-such" / "summary.json"), local) is False
        assert list(local.parent.iterdir()) == []
        (tmp_path / "s.json").write_text('{"ok": true}')
        assert fetch(runner, str(tmp_path / "s.json"), local) is True
        assert local.read_text() == '{"ok": true}' and sorted(p.name for p in local.parent.iterdir()) == [
            "summary.json"
        ]
    finally:
        runner.close()


def test_a_run_file_on_a_full_disk_says_disk_full(tmp_path):
    """state.json and the other run files: the same line through ops.runstate.write_json."""
    with tmpfs(tmp_path / "runs", "4k") as runs:
        with pytest.raises(OpsError, match=r"^disk full: cannot write .*state\.json: No space left on dev"):
            write_json(runs / "state.json", {"log": "x" * 20000})
        assert list(runs.iterdir()) == []
