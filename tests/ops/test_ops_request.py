"""The one request object of the stage commands, built once from their click options."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.errors import ConfigError
from ops.request import RunRequest


def test_options_become_one_request_with_parsed_arguments():
    """The click options land in typed fields; the stage's words after `--` are parsed once; `a,b` is a
    multi-host request in rank order, one name a one-host request."""
    request = RunRequest.from_options(
        host_spec="a, b",
        stage="verify",
        runs_dir="out",
        run_id="r1",
        extra=("--dtype", "float32"),
        lock_wait=5.0,
    )
    assert request.multi_host and request.hosts == ("a", "b") and request.runs_dir == Path("out")
    assert (
        request.args.dtype == "float32"
        and request.args.argv == ("--dtype", "float32")
        and request.lock_wait == 5.0
    )
    one = RunRequest.from_options(host_spec="gpu1")
    assert not one.multi_host and one.host == "gpu1" and one.stage == "extract" and not one.restore_server
    with pytest.raises(ConfigError, match="takes one host"):
        request.host


@pytest.mark.parametrize(
    "spec,options,words",
    [
        ("a,b", {"detach": True}, "--detach runs one host"),
        ("a", {"detach": True, "restore_server": True}, "--restore-server with --detach"),
        ("a,,b", {}, "empty item"),
        ("a,b,a", {}, "names a twice"),
        ("a", {"extra": ("--world-size",)}, "needs a value"),
    ],
)
def test_requests_that_cannot_run_are_refused_before_any_host_is_touched(spec, options, words):
    """--detach with several hosts or with --restore-server, a bad host list, a bad stage argument."""
    with pytest.raises(ConfigError, match=words):
        RunRequest.from_options(host_spec=spec, **options)
