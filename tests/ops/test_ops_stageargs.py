"""The one reading of the operator's stage arguments (click's rule), and the plan fields built from it."""

from __future__ import annotations

import pytest

from ops.errors import ConfigError
from ops.hosts import HostConfig
from ops.layout import Layout
from ops.stage import plan_stage, replan
from ops.stageargs import StageArgs, last_values, parse


def test_the_last_one_wins_in_either_spelling():
    """A repeated option takes its last value, whether written `--flag V` or `--flag=V`, as click does."""
    args = parse(
        ("--dtype", "bfloat16", "--limit", "3", "--dtype=float32", "--world-size=2", "--world-size", "4")
    )
    assert (args.dtype, args.world_size) == ("float32", 4)
    assert parse(("--backend=vllm", "--backend", "hf")).backend == "hf"
    assert parse(("--tensor-parallel-size", "2", "--tensor-parallel-size=8")).tensor_parallel_size == 8
    assert parse(("--data-parallel=3",)).data_parallel == 3 and parse(("--rank", "1")).rank == 1


def test_values_are_typed_and_words_pass_through_unchanged():
    """The stage gets the words as given; ops reads ints as ints; what it does not know stays unread."""
    words = ("--limit", "3", "--dtype", "float16", "--trust-remote-code")
    args = parse(words)
    assert args == StageArgs(words, dtype="float16") and args.argv == words
    assert parse(()) == StageArgs()
    assert last_values(("--model", "/m", "--out=/o", "--model", "/n"), ("--model", "--out")) == {
        "--model": "/n",
        "--out": "/o",
    }


@pytest.mark.parametrize(
    "words,message",
    [
        (("--limit", "3", "--dtype"), "--dtype after `--` needs a value"),
        (("--world-size",), "--world-size after `--` needs a value"),
        (("--world-size", "two"), "--world-size 'two' after `--` must be a whole number"),
        (("--data-parallel=",), "--data-parallel '' after `--` must be a whole number"),
    ],
)
def test_a_missing_or_bad_value_is_refused(words, message):
    """A value-taking option with nothing after it, or a count that is no number: one ConfigError naming
    it."""
    with pytest.raises(ConfigError, match=message):
        parse(words)


def test_a_bare_double_dash_ends_the_options():
    """After `--` click reads no options: a word like `--dtype` there is an argument, not the dtype."""
    assert parse(("--dtype", "float32", "--", "--dtype", "bfloat16")).dtype == "float32"
    assert parse(("--", "--world-size")).world_size is None


def test_plan_fields_come_from_the_parse_and_shards_render_last():
    """The plan's dtype and world size are the parsed values; a multi-host shard is a field rendered after the
    operator's words; replan keeps both."""
    host = HostConfig(name="h", host="local")
    plan = plan_stage(
        host,
        "extract",
        run_id="r",
        extra_args=("--dtype=bfloat16", "--world-size", "2", "--dtype", "float32"),
    )
    assert (plan.dtype, plan.world_size, plan.shard) == ("float32", 2, None)
    sharded = plan_stage(host, "extract", run_id="r", extra_args=("--limit", "4"), shard=(3, 1))
    assert sharded.world_size == 3 and sharded.extra_args == ("--limit", "4")
    assert sharded.stage_argv[-6:] == ("--limit", "4", "--world-size", "3", "--rank", "1")
    again = replan(host, sharded, layout=Layout("hf", 1, 2))
    assert again.shard == (3, 1) and again.stage_argv[-6:] == sharded.stage_argv[-6:]
    assert "--data-parallel" in again.stage_argv
    with pytest.raises(ConfigError, match="needs a value"):
        plan_stage(host, "extract", run_id="r", extra_args=("--dtype",))
