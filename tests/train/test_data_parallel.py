"""Data parallel on the CPU (``torchrun --nproc-per-node N -m pipeline train`` with gloo, speculators' DDP):
the producer's merged schedule of every rank's batches, and real 2-rank runs offline and online."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.ondisk import formats
from pipeline.train import stage, states
from pipeline.train.config import TrainConfig
from tests.conftest import REPO
from tests.train.states_helpers import (
    RANKS,
    TORCHRUN,
    BytesWatch,
    budget_for,
    checkpoint_weights,
    cli_args,
    extract_per_sample,
    kill_job,
    committed_step,
    make_stage_inputs,
    pipeline_env,
    rows_seen,
    states_config,
    still_alive,
    train_losses,
    torchrun,
    train_rows,
)


# ---------------------------------------------------------------- the merged schedule (pure)


def _loader_batches(lengths: dict[int, int], directory: Path, world_size: int, rank: int, epoch: int):
    """What rank ``rank``'s training loader (pipeline/train/data.py) reads in ``epoch``: dataset indices."""
    from pipeline.train.data import make_loader

    files = [formats.data_file(directory, i) for i in range(len(lengths))]
    loader = make_loader(
        files,
        max_len=200,
        hidden_size=8,
        world_size=world_size,
        rank=rank,
        seed=3,
        workers=0,
        pin_memory=False,
    )
    loader.batch_sampler.set_epoch(epoch)
    return [[int(i) for i in b] for b in loader.batch_sampler], loader.dataset.approx_lengths


@pytest.mark.parametrize("world_size", [2, 3])
def test_merged_batches_are_every_ranks_loader_batches_step_by_step(tmp_path, world_size):
    """For W ranks the producer's epoch is rank 0's first batch, rank 1's first, ..., rank 0's second, ...:
    exactly what each rank's loader reads, every rank the same number of steps, no sample twice."""
    lengths = {i: 20 + (i * 37) % 90 for i in range(41)}
    formats.write_sample_lengths(tmp_path, lengths)
    for epoch in range(3):
        per_rank = [_loader_batches(lengths, tmp_path, world_size, r, epoch) for r in range(world_size)]
        approx = per_rank[0][1]
        merged = states.epoch_batches(approx, 200, 3, epoch, world_size)
        steps = len(per_rank[0][0])
        assert steps > 1 and all(len(b) == steps for b, _ in per_rank)
        assert merged == [per_rank[r][0][s] for s in range(steps) for r in range(world_size)]
        flat = [i for batch in merged for i in batch]
        assert len(flat) == len(set(flat))


def test_one_rank_is_the_loaders_own_order(tmp_path):
    """W=1 (the default): one sampler's batches, unchanged."""
    lengths = {i: 20 + (i * 37) % 90 for i in range(30)}
    formats.write_sample_lengths(tmp_path, lengths)
    for epoch in range(2):
        real, approx = _loader_batches(lengths, tmp_path, 1, 0, epoch)
        assert states.epoch_batches(approx, 200, 3, epoch) == real
        assert states.epoch_batches(approx, 200, 3, epoch, world_size=1) == real


def test_a_resumed_epoch_skips_each_ranks_checkpointed_steps():
    """A checkpoint after step k holds k steps of every rank: production starts at merged batch k * W."""
    lengths = [20 + (i * 37) % 90 for i in range(24)]
    merged = states.epoch_batches(lengths, 200, 3, 0, RANKS)
    train = list(range(24))
    resumed = states.production_order([merged], 2 * RANKS, train, [], frozenset(), frozenset())
    assert resumed == [i for batch in merged[2 * RANKS :] for i in batch]


# ---------------------------------------------------------------- 2 ranks on the tiny Llama, real processes


@pytest.fixture(scope="module")
def dp_inputs(tmp_path_factory, tiny_llama, conversations) -> dict:
    """The tiny Llama's prepared set and verifier (tests/train/states_helpers.py), and extract's states of
    it (one sample per forward, as the online producer below writes them)."""
    root = tmp_path_factory.mktemp("dp-inputs")
    inputs = make_stage_inputs(root, tiny_llama, conversations)
    extract_per_sample(inputs, root / "states")
    return {**inputs, "states": root / "states"}


@pytest.fixture(scope="module")
def offline_ddp(dp_inputs, tmp_path_factory) -> TrainConfig:
    """The 2-rank offline run on extract's states (speculators' DDP, the tests' default config): the
    reference of the online and the FSDP tests, trained once for both."""
    cfg = states_config(dp_inputs, dp_inputs["states"], tmp_path_factory.mktemp("dp-offline") / "offline")
    done = torchrun(cli_args(cfg))
    assert done.returncode == 0, done.stderr[-4000:]
    return cfg


@pytest.mark.slow
def test_two_ranks_online_give_the_two_rank_offline_draft_bit_for_bit(dp_inputs, offline_ddp, tmp_path):
    """2 CPU ranks (gloo, speculators' DDP), once offline on extract's states and once online under a budget
    well under the set: rank 0 produces for both ranks in their reading order, each rank reads and deletes
    its own transient files. The same data order gives the same checkpoint weights bit for bit and the same
    losses; the state files never exceed the budget (the producer's ledger and a sampler of the disk agree);
    only the kept files remain and `pipeline verify` passes them."""
    from pipeline import verify

    ref = offline_ddp
    off = json.loads((ref.out / "summary.json").read_text())["train"]
    assert off["world_size"] == RANKS and off["device"] == "cpu" and off["complete"]

    budget = budget_for(ref.data, held=4)  # the 4 held-out kept (--no-eval) and room for 2 more files
    total = sum(p.stat().st_size for p in ref.data.glob("data_*.pt"))
    assert int(budget) < 0.5 * total  # less than half the set
    cfg = states_config(
        dp_inputs,
        tmp_path / "states",
        tmp_path / "online",
        states_mode="online",
        states_budget=budget,
        states_max_batch_size=1,
    )
    with BytesWatch(cfg.data) as watch:
        done = torchrun(cli_args(cfg))
    assert done.returncode == 0, done.stderr[-4000:]
    on = json.loads((cfg.out / "summary.json").read_text())["train"]
    assert on["world_size"] == RANKS and on["steps_per_epoch"] == off["steps_per_epoch"]
    st = on["states"]
    assert st["peak_bytes"] <= int(budget) and watch.max <= int(budget), (st["peak_bytes"], watch.max, budget)
    # the 4 held-out once, every training sample each epoch: transient ones came, were read and went
    assert st["produced_samples"] == 4 + 12 * cfg.epochs and st["producer_room_wait_seconds"] > 0
    assert st["producer"] == "thread"  # the hf producer: a thread of rank 0's
    for epoch in range(cfg.epochs):
        a, b = checkpoint_weights(ref.out, epoch), checkpoint_weights(cfg.out, epoch)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), epoch
    assert train_losses(cfg.out) == train_losses(ref.out)

    kept = set(formats.read_data_config(cfg.data).extra["states"]["kept"])
    on_disk = formats.existing_data_indices(cfg.data)
    assert set(on_disk) == kept and len(on_disk) == st["kept_samples"] == st["files_on_disk"]
    assert not list(cfg.data.glob(".*partial")) and not (cfg.data / states.FAILED).exists()
    for i in on_disk:  # one sample per forward on both sides: extract's bytes
        assert formats.data_file(cfg.data, i).read_bytes() == formats.data_file(ref.data, i).read_bytes()
    result = verify.verify(verify.VerifyConfig(path=cfg.data))
    assert not [c for c in result.checks if c.status == "fail"], result.checks


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
@pytest.mark.parametrize("workers", [0, 2])
def test_a_failed_producer_ends_every_rank_in_one_line(dp_inputs, small_disk, tmp_path, workers):
    """The disk under rank 0's producer fills: the other rank's reader sees the FAILED file, leaves rank 0
    the report, and rank 0 ends the job (torchrun's first failure) with the producer's cause in one line, the
    only error line; nothing hangs, no partial file is left."""
    cfg = states_config(
        dp_inputs,
        small_disk,
        tmp_path / "out",
        states_mode="online",
        states_budget="50M",
        num_workers=workers,
    )
    t0 = time.monotonic()
    done = torchrun(cli_args(cfg), timeout=300)
    assert done.returncode != 0 and time.monotonic() - t0 < stage.REPORT_GRACE_S + 60
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr[-4000:]
    assert errors[0].startswith("error: the states producer failed: writing states to")
    assert os.strerror(28) in errors[0] and "--resume" in errors[0]
    first = done.stderr[done.stderr.index("Root Cause (first observed failure)") :]
    assert "rank      : 0 (local_rank: 0)" in first and "exitcode  : 2" in first, first
    assert not list(small_disk.glob(".*partial"))


@pytest.mark.slow
def test_a_rank_orphaned_by_a_killed_rank0_and_agent_ends_in_one_line(dp_inputs, tmp_path):
    """torchrun's agent and rank 0 SIGKILLed together while rank 1 waits for a state file that rank 0's
    producer (a thread, stalled here before its first file) will now never write: nothing marks the run
    failed and nobody is left to end rank 1, yet it ends on its own once rank 0's heartbeat has been silent
    for STALE_S (3 s here) and its process is gone: one error line naming the gone pid, no process left, the
    run marked failed for --resume. Before the heartbeat it waited forever."""
    import psutil

    markers = tmp_path / "markers"
    markers.mkdir()
    cfg = states_config(
        dp_inputs, tmp_path / "states", tmp_path / "out", states_mode="online", states_budget="50M"
    )
    stale = 3  # then rank 0's pid is asked: a live rank 0, however slow to beat, is never taken for gone
    env = {**pipeline_env(), "STALL_MARKERS": str(markers), "STALL_STALE_S": str(stale)}
    job = subprocess.Popen(
        [*TORCHRUN, "-m", "tests.train.stalled_train", *cli_args(cfg)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    orphans: list[int] = []  # once the agent is killed, kill_job cannot find the ranks: the test kills them
    try:
        deadline = time.monotonic() + 300
        while not all((markers / f"waiting-rank{r}").exists() for r in range(RANKS)):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=60)[1][-4000:]
            time.sleep(0.2)
        assert (markers / "producer").exists() and (cfg.data / states.ALIVE).is_file()
        ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(job.pid).children()}
        assert sorted(ranks) == list(range(RANKS)), ranks
        rank1 = ranks[1]
        rest = [p.pid for p in rank1.children(recursive=True)]
        orphans = [rank1.pid, *rest]
        for pid in (job.pid, ranks[0].pid):
            os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        # rank 1 holds the job's pipes: they close when it ends
        _, err = job.communicate(timeout=states.HEARTBEAT_S + stale + 120)
        ended = time.monotonic() - t0
    except BaseException:
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        kill_job(job)
        raise
    assert not still_alive(orphans, within=30), "rank 1 or a process of it outlived the job"
    # the silence, then no REPORT_GRACE_S for a rank 0 that is gone (with it: at least stale + 30 s)
    assert ended < stale + stage.REPORT_GRACE_S, f"rank 1 took {ended:.0f} s: it waited for a gone rank 0"
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err[-4000:]
    assert errors[0].startswith("error: the states producer failed: rank 0's process stopped without ending")
    assert f"its process {ranks[0].pid} is gone" in errors[0] and "--resume" in errors[0]
    assert (cfg.data / states.FAILED).read_text().startswith(states.ORPHANED)


@pytest.mark.slow
def test_two_ranks_killed_mid_epoch_resume_to_the_offline_draft(dp_inputs, tmp_path):
    """A 3-epoch 2-rank hybrid job checkpointing every step, SIGKILLed whole after its second epoch's second
    step, then resumed: rank 0's producer starts at the checkpointed step of both ranks (W batches a step),
    the killed job's transient files are removed, no step is trained twice, the budget holds, and the draft
    equals the uninterrupted 2-rank offline one bit for bit."""
    ref = states_config(dp_inputs, dp_inputs["states"], tmp_path / "offline", epochs=3)
    assert torchrun(cli_args(ref)).returncode == 0
    steps = json.loads((ref.out / "summary.json").read_text())["train"]["steps_per_epoch"]
    cfg = states_config(
        dp_inputs,
        tmp_path / "states",
        tmp_path / "hybrid",
        states_mode="hybrid",
        states_budget=budget_for(ref.data, held=6),
        states_max_batch_size=1,
        checkpoint_steps=1,
        epochs=3,
    )
    with BytesWatch(cfg.data) as watch:
        job = subprocess.Popen(
            [*TORCHRUN, "-m", "pipeline", *cli_args(cfg)],
            cwd=REPO,
            env=pipeline_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # the row of epoch 1's step 2 is logged after its step 1's checkpoint: a mid-epoch one
        rows_seen(job, cfg.out, steps + 2, 600)
        pids = kill_job(job)
        rows = len(train_rows(cfg.out))
        assert steps + 2 <= rows < 3 * steps, f"the kill landed after the last epoch ({rows} steps)"
        assert not still_alive(pids, within=30), "a rank outlived its killed job"
        committed, local = committed_step(cfg.out)
        resumed = torchrun([*cli_args(cfg), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resuming at step {committed}" in resumed.stderr and 0 < local < steps
    assert [r["step"] for r in train_rows(cfg.out)] == list(range(3 * steps))
    assert watch.max <= int(cfg.states_budget), (watch.max, cfg.states_budget)
    for epoch in range(cfg.epochs):
        a, b = checkpoint_weights(ref.out, epoch), checkpoint_weights(cfg.out, epoch)
        assert all(torch.equal(a[k], b[k]) for k in a), epoch
    kept = set(formats.read_data_config(cfg.data).extra["states"]["kept"])
    assert set(formats.existing_data_indices(cfg.data)) == kept and not list(cfg.data.glob(".*partial"))


@pytest.mark.slow
def test_fsdp_shards_the_draft_and_trains_what_ddp_trains(dp_inputs, offline_ddp, tmp_path):
    """`--fsdp` under torchrun (2 CPU ranks, speculators' FSDP on gloo): each rank holds a shard of the draft
    and its optimizer state, the checkpoints are full state dicts gathered by rank 0, and the weights after
    each epoch are the DDP run's up to the reductions' summation order; the exported draft is there. One
    process with --fsdp is refused in one line before anything is written."""
    ddp = offline_ddp
    fsdp = states_config(dp_inputs, dp_inputs["states"], tmp_path / "fsdp")
    done = torchrun([*cli_args(fsdp), "--fsdp"])
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((fsdp.out / "summary.json").read_text())
    assert summary["complete"] and summary["train"]["world_size"] == RANKS
    assert summary["train"]["data_parallel"] == "fsdp"  # the trainer's model is an FSDP module
    assert json.loads((ddp.out / "summary.json").read_text())["train"]["data_parallel"] == "ddp"
    assert json.loads((fsdp.out / "train_config.json").read_text())["fsdp"] is True
    assert (fsdp.out / "draft" / "config.json").is_file()
    for epoch in range(fsdp.epochs):
        a, b = checkpoint_weights(ddp.out, epoch), checkpoint_weights(fsdp.out, epoch)
        assert a.keys() == b.keys()
        worst = max(float((a[k] - b[k]).abs().max()) for k in a)
        assert worst < 1e-4, (epoch, worst)
    losses = train_losses(fsdp.out)
    assert losses == pytest.approx(train_losses(ddp.out), rel=1e-4)

    alone = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            *cli_args(states_config(dp_inputs, dp_inputs["states"], tmp_path / "one")),
            "--fsdp",
        ],
        cwd=REPO,
        env=pipeline_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert alone.returncode == 2, alone.stderr
    assert alone.stderr.strip().splitlines()[-1].startswith("error: --fsdp shards the draft over torchrun's")
    assert not (tmp_path / "one").exists()
