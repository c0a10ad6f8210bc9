"""Multi-host planning, merging and exit codes (pure parts of ops.fanout), and the one-host flow's
failures turned into rows on a real (local) runner."""

from __future__ import annotations

import io
import threading

import pytest

from ops import fanout
from ops.errors import EXIT_HOSTS_FAILED, ConfigError
from ops.fanout import FAILED, OK, SKIPPED, HostResult, merge, plan_fanout, shard_complete
from ops.hosts import HostConfig
from ops.request import RunRequest, split_hosts


def host(name: str, root: str = "/data/eagle") -> HostConfig:
    return HostConfig(name=name, host=f"{name}.example", data_root=root)


HOSTS = [host("a"), host("b", "/disk2/eagle"), host("c")]


def summary(rank: int, world: int, samples: int, missing=(), tokens_per_file: int = 10) -> dict:
    owned = [i for i in range(rank, samples, world) if i not in missing]
    return {
        "ok": not missing,
        "checks": []
        if not missing
        else [{"name": "contiguity", "status": "fail", "detail": f"missing {list(missing)}"}],
        "stats": {
            "samples": samples,
            "files": len(owned),
            "world_size": world,
            "rank": rank,
            "missing": list(missing),
            "tokens": tokens_per_file * len(owned),
        },
    }


def test_each_host_gets_its_rank_the_same_run_id_and_its_own_output():
    """Host i of N runs the stage with --world-size N --rank i after the operator's arguments, under one
    run id, writing to the stage output under its own data root."""
    plan = plan_fanout(HOSTS, "extract", run_id="r1", extra=("--limit", "12"))
    assert plan.world_size == 3 and plan.hosts == ("a", "b", "c")
    for rank, job in enumerate(plan.jobs):
        assert job.rank == rank and job.plan.run_id == "r1" and job.skip is None and not job.plan.resume
        assert job.plan.stage_argv[-6:] == ("--limit", "12", "--world-size", "3", "--rank", str(rank))
        assert job.plan.stage_argv[:4] == ("python", "-m", "pipeline", "extract")
    assert [j.plan.host_output for j in plan.jobs] == [
        "/data/eagle/hidden_states",
        "/disk2/eagle/hidden_states",
        "/data/eagle/hidden_states",
    ]
    verify = plan_fanout(HOSTS[:2], "verify", run_id="v1")
    assert verify.jobs[1].plan.stage_argv == (
        "python",
        "-m",
        "pipeline",
        "verify",
        "/data/hidden_states",
        "--world-size",
        "2",
        "--rank",
        "1",
    )
    assert plan_fanout(HOSTS[:2], "extract", run_id=None).jobs[0].plan.run_id.startswith("extract-")


@pytest.mark.parametrize(
    "hosts, stage, extra, words",
    [
        (HOSTS, "train", (), "cannot be split"),
        (HOSTS, "prepare", (), "cannot be split"),
        ([host("a"), host("a")], "extract", (), "appear twice"),
        (HOSTS, "extract", ("--rank", "1"), "--rank is set per host"),
        (HOSTS, "extract", ("--world-size=4",), "--world-size=4 is set per host"),
        (HOSTS, "extract", ("--out", "/x"), "--out is set per host"),
    ],
)
def test_bad_plans_are_refused_with_one_line(hosts, stage, extra, words):
    """Stages that do not shard, a host named twice, and shard flags in the stage arguments are usage
    errors, raised before anything connects."""
    with pytest.raises(ConfigError) as exc:
        plan_fanout(hosts, stage, run_id="r1", extra=extra)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_split_hosts():
    """`a,b` splits in order; an empty item or a repeated name is refused."""
    assert split_hosts("a, b,c") == ["a", "b", "c"]
    for bad in ("a,,b", "a,", "a,b,a"):
        with pytest.raises(ConfigError):
            split_hosts(bad)


def test_shard_complete_needs_this_shard_all_files_and_ok():
    """A summary counts as a complete shard only if it is ok, of this world size and rank, and has every
    file the shard owns."""
    assert shard_complete(summary(1, 2, 7), 2, 1)
    assert not shard_complete(summary(1, 2, 7, missing=(3,)), 2, 1)
    assert not shard_complete(summary(1, 2, 7), 2, 0)
    assert not shard_complete(summary(1, 2, 7), 3, 1)
    assert not shard_complete(None, 2, 1)
    whole = summary(0, 1, 7)
    whole["stats"]["files"] = 6
    assert not shard_complete(whole, 1, 0)


def test_merge_covers_every_file_once_when_all_shards_complete():
    """Totals add files and tokens of all hosts; all ranks complete and files == samples means complete."""
    plan = plan_fanout(HOSTS, "extract", run_id="r1")
    res = [HostResult(h, r, OK, 0, summary=summary(r, 3, 10), seconds=2.0) for r, h in enumerate("abc")]
    m = merge(plan, res)
    assert m["complete"] and m["totals"]["files"] == 10 and m["totals"]["tokens"] == 100
    assert m["totals"]["complete_ranks"] == [0, 1, 2] and m["totals"]["missing_files"] == []
    assert [s["files"] for s in m["hosts"]] == [4, 3, 3] and m["host_order"] == ["a", "b", "c"]
    assert fanout.exit_code(m) == 0 and m["attempts"] == 1


def test_merge_names_missing_files_of_failed_and_partial_hosts():
    """A host with no summary misses its whole shard; a host with a partial summary misses what it lists;
    the run is incomplete and exits EXIT_HOSTS_FAILED."""
    plan = plan_fanout(HOSTS, "extract", run_id="r1")
    res = [
        HostResult("a", 0, OK, 0, summary=summary(0, 3, 10)),
        HostResult("b", 1, FAILED, 3, "connection to x refused"),
        HostResult("c", 2, FAILED, 1, "stage exit code 1", summary=summary(2, 3, 10, missing=(5,))),
    ]
    m = merge(plan, res)
    assert not m["complete"] and fanout.exit_code(m) == EXIT_HOSTS_FAILED == 13
    assert m["totals"]["complete_ranks"] == [0] and m["totals"]["incomplete_ranks"] == [1, 2]
    assert m["totals"]["missing_files"] == [1, 4, 5, 7]
    assert m["hosts"][1]["error"] == "connection to x refused" and m["hosts"][1]["files"] == 0
    assert fanout.exit_code(m, interrupted=True) == 130


def test_a_record_written_mid_run_resumes_the_running_hosts():
    """The record written while host b still runs: a complete, b incomplete; a re-run from it skips a and
    resumes b (what an operator's crash mid-run leaves behind)."""
    plan = plan_fanout(HOSTS[:2], "extract", run_id="r1")
    mid = merge(
        plan,
        [
            HostResult("a", 0, OK, 0, summary=summary(0, 2, 6)),
            HostResult("b", 1, fanout.RUNNING, error="did not report"),
        ],
    )
    assert not mid["complete"] and mid["totals"]["missing_files"] == [1, 3, 5]
    again = plan_fanout(HOSTS[:2], "extract", run_id="r1", previous=mid)
    assert again.jobs[0].skip and again.jobs[1].skip is None and again.jobs[1].plan.resume


def test_merge_without_any_summary_marks_ranks_unknown():
    """When no host reported the sample count, the missing files cannot be named: the ranks are listed."""
    plan = plan_fanout(HOSTS[:2], "extract", run_id="r1")
    m = merge(plan, [HostResult("a", 0, FAILED, 3, "refused"), HostResult("b", 1, FAILED, 3, "refused")])
    assert not m["complete"] and m["totals"]["samples"] is None and m["totals"]["unknown_ranks"] == [0, 1]


def test_rerun_skips_complete_shards_and_resumes_the_others():
    """An earlier record of the same run id: its complete hosts are skipped, every other host runs with
    --resume; the skipped host's section is carried over into the new record."""
    first = plan_fanout(HOSTS[:2], "extract", run_id="r1", extra=("--limit", "8"))
    prev = merge(
        first, [HostResult("a", 0, OK, 0, summary=summary(0, 2, 8)), HostResult("b", 1, FAILED, 3, "refused")]
    )
    plan = plan_fanout(HOSTS[:2], "extract", run_id=None, extra=("--limit", "8"), previous=prev)
    assert plan.run_id == "r1"
    a, b = plan.jobs
    assert a.skip and "shard 0/2 verified complete" in a.skip
    assert b.skip is None and b.plan.resume and "--resume" in b.plan.stage_argv
    again = merge(
        plan,
        [
            HostResult("a", 0, SKIPPED, 0, previous=prev["hosts"][0]),
            HostResult("b", 1, OK, 0, summary=summary(1, 2, 8)),
        ],
    )
    assert (
        again["complete"]
        and again["attempts"] == 2
        and [h["status"] for h in again["hosts"]] == ["skipped", "ok"]
    )
    assert again["totals"]["files"] == 8


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(hosts=[host("b"), host("a")]), "was made with hosts a,b"),
        (dict(stage="verify"), "was a extract run"),
        (dict(extra=("--limit", "9")), "stage arguments"),
    ],
)
def test_rerun_with_other_hosts_stage_or_arguments_is_refused(change, words):
    """The shards of a run depend on the host order, stage and arguments: a re-run that changes any of
    them is a usage error, not a silently different split."""
    first = plan_fanout(HOSTS[:2], "extract", run_id="r1", extra=("--limit", "8"))
    prev = merge(first, [HostResult("a", 0, OK, 0, summary=summary(0, 2, 8))])
    kw = dict(hosts=HOSTS[:2], stage="extract", extra=("--limit", "8")) | change
    with pytest.raises(ConfigError) as exc:
        plan_fanout(kw["hosts"], kw["stage"], run_id="r1", extra=kw["extra"], previous=prev)
    assert words in str(exc.value)


def test_find_previous_takes_the_run_id_or_the_latest_matching_record(tmp_path):
    """--run-id reads runs/<id>/summary.json; --resume alone takes the newest record of the same stage
    and host list, and says so when there is none."""
    plan = plan_fanout(HOSTS[:2], "extract", run_id="old")
    for run_id, stamp in (("old", "2026-01-01T00:00:00Z"), ("new", "2026-02-01T00:00:00Z")):
        rec = merge(plan, []) | {"run_id": run_id, "updated": stamp}
        (tmp_path / run_id).mkdir()
        fanout.write_json(tmp_path / run_id / "summary.json", rec)
    assert fanout.find_previous(tmp_path, None, "extract", ["a", "b"])["run_id"] == "new"
    assert fanout.find_previous(tmp_path, "old", "extract", ["a", "b"])["run_id"] == "old"
    assert fanout.find_previous(tmp_path, "none", "extract", ["a", "b"]) is None
    with pytest.raises(ConfigError, match="no earlier extract run of hosts b,a"):
        fanout.find_previous(tmp_path, None, "extract", ["b", "a"])


def test_prefixed_lines_keep_whole_lines_per_host():
    """Two hosts writing pieces of lines at once: every output line is one whole line of one host."""
    sink, lock = io.StringIO(), threading.Lock()
    outs = [fanout.PrefixedLines(f"{n} | ", sink, lock) for n in ("a", "b")]

    def write(out, n):
        for i in range(200):
            out.write(f"{n}-line ")
            out.write(f"{i}\n")

    threads = [threading.Thread(target=write, args=(o, n)) for o, n in zip(outs, "ab")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = sink.getvalue().splitlines()
    assert len(lines) == 400
    for n in "ab":
        assert [ln for ln in lines if ln.startswith(f"{n} | ")] == [f"{n} | {n}-line {i}" for i in range(200)]


def test_a_host_that_cannot_connect_becomes_a_failed_row(tmp_path):
    """run_fanout with one host refused by the connection and one whose preflight fails on a real local
    runner: both are rows with their reasons, the record is written, nothing raises."""
    from ops.connection import LocalRunner
    from ops.errors import ConnectError
    from rich.console import Console

    def connect(h, accept_new_host_key=False):
        if h.name == "a":
            raise ConnectError("connection to u@a:22 refused; check host and port")
        return LocalRunner(h.name)

    from ops_procs import write_gpu_table

    # a readable GPU table with no GPU: the preflight reads it and fails on the missing image and data root
    # (a table that is not there at all is refused earlier, exit 6: test_ops_gpu_facts_lasting.py)
    table = write_gpu_table(tmp_path / "gpus.json", [])
    hosts = [
        host("a"),
        HostConfig(
            name="b",
            host="local",
            data_root=str(tmp_path / "nothing"),
            image="no-such:0",
            python="/usr/bin/python3",
            gpu_source=f"table:{table}",
            device_glob=str(tmp_path / "dev*"),
        ),
    ]
    plan = plan_fanout(hosts, "extract", run_id="f1")
    out = io.StringIO()
    request = RunRequest(hosts=("a", "b"), runs_dir=tmp_path / "runs")
    merged, interrupted = fanout.run_fanout(
        plan, request, connect=connect, console=Console(file=out, width=200)
    )
    assert not interrupted and not merged["complete"]
    a, b = merged["hosts"]
    assert a["status"] == b["status"] == FAILED and a["exit_code"] == 3 and "refused" in a["error"]
    assert b["exit_code"] == 4 and b["error"].startswith("preflight failed")
    assert (tmp_path / "runs" / "f1" / "summary.json").is_file()
    assert "a | failed: connection to u@a:22 refused" in out.getvalue()


def test_each_host_plan_carries_its_secret_names_never_values():
    """The operator's secrets reach every host's plan by name (env file), as for one host; values stay out of
    argv."""
    import dataclasses

    hosts = [dataclasses.replace(HOSTS[0], secrets=("HF_TOKEN", "FOO_API_KEY")), HOSTS[1]]
    env = {"HF_TOKEN": "hf_canary_value_123", "FOO_API_KEY": "key_canary_456"}
    plan = plan_fanout(hosts, "extract", run_id="r1", environ=env)
    assert plan.jobs[0].plan.secret_names == ("HF_TOKEN", "FOO_API_KEY")
    assert plan.jobs[1].plan.secret_names == ("HF_TOKEN",)
    for job in plan.jobs:
        assert not any(v in " ".join(job.plan.docker_run) for v in env.values())
    with pytest.raises(ConfigError, match="HF_TOKEN"):
        plan_fanout(hosts, "extract", run_id="r1", environ={"HF_TOKEN": "two\nlines"})


def test_multi_host_dry_run_prints_every_plan_and_detach_is_refused(tmp_path):
    """`--dry-run` with several hosts prints each host's shard plan and connects to nothing; `--detach` is
    refused."""
    import subprocess
    import sys

    hosts = "u@127.0.0.1:1,u@127.0.0.2:1"  # port 1: a connection attempt would fail loudly
    cmd = [
        sys.executable,
        "-m",
        "ops",
        "remote-extract",
        "--host",
        hosts,
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    dry = subprocess.run([*cmd, "--dry-run", "--run-id", "d1"], capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "--world-size 2 --rank 0" in dry.stdout and "--world-size 2 --rank 1" in dry.stdout
    assert not (tmp_path / "runs").exists()
    det = subprocess.run([*cmd, "--detach"], capture_output=True, text=True, timeout=120)
    assert det.returncode == 2 and "--detach" in det.stderr and det.stderr.count("\n") == 1, det.stderr
