"""The one restore policy's decisions that need no host (the host-side ones: test_ops_server_errors.py,
test_ops_interrupt_policy.py, test_ops_remote_run.py)."""

from __future__ import annotations

import pytest

from ops.gpus import ServerFacts
from ops.hosts import HostConfig, parse_strategy
from ops.restore import restore


class NoHost:
    """A runner that fails the test when the policy reaches for the host."""

    def run(self, *a, **kw):
        raise AssertionError(f"the host was asked: {a}")

    def __getattr__(self, name):
        raise AssertionError(f"the host was used: {name}")


def test_a_run_restores_only_a_server_it_saw_running():
    """A run whose server was not running before its stop starts nothing and asks the host nothing."""
    host = HostConfig(name="h", host="local", server=parse_strategy("container:vllm"))
    assert restore(NoHost(), host, stopped=ServerFacts("container", ("c1",))) == []


def test_a_running_server_seen_before_the_stop_is_started_again():
    """The facts from before the stop, with nothing running now: the start steps run (after the stage
    check)."""
    calls = []

    class Runner:
        def run(self, cmd, **kw):
            calls.append(cmd)
            from ops.connection import Result

            return Result(cmd, 0, "", "")

    host = HostConfig(name="h", host="local", server=parse_strategy("container:vllm"))
    done = restore(Runner(), host, stopped=ServerFacts("container", ("c1",), ("c1",)))
    assert done == ["start server: docker start vllm"] and calls[-1] == "docker start vllm"
    assert calls[0].startswith("docker ps")  # refused beside a running stage container: checked first


def test_exactly_one_way_in():
    """A run's own restore (stopped=) or a command's (command=, under the lock), never both or neither."""
    host = HostConfig(name="h", host="local")
    with pytest.raises(ValueError):
        restore(NoHost(), host)
    with pytest.raises(ValueError):
        restore(NoHost(), host, stopped=ServerFacts("none"), command="restore-server")
