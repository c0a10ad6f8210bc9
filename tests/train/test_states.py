"""Training on states produced while the draft trains (``--states-mode online|hybrid``): the plan, the same
draft as offline, the budget on disk, resume after SIGKILL, and the refusals."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from pipeline.errors import StageError
from pipeline.ondisk import formats
from pipeline.train import states
from tests.train.states_helpers import (
    EPOCHS,
    SAMPLES,
    assert_recovered,
    budget_for,
    checkpoint_weights,
    cli_args,
    interrupt_then_resume,
    states_config,
    still_alive,
    train_losses,
)


# ---------------------------------------------------------------- the plan (pure)


def test_budget_sizes_parse_and_bad_ones_are_refused():
    """Decimal and binary units and plain bytes are read; anything else is one line naming the flag."""
    assert states.parse_bytes("500G") == 500 * 10**9
    assert states.parse_bytes("1.5T") == 1_500_000_000_000
    assert states.parse_bytes("64GiB") == 64 * 2**30
    assert states.parse_bytes("12345") == 12345
    for bad in ("", "ten", "5X", "-1G", "0"):
        with pytest.raises(StageError, match="--states-budget"):
            states.parse_bytes(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_file_size_bound_holds_for_real_files(tmp_path, dtype):
    """``sample_bytes`` bounds the size of the file ``write_sample`` writes (the budget relies on it), and
    not loosely: within FILE_OVERHEAD of it."""
    for length in (1, 2, 9, 130):
        for hidden in (8, 64, 300):
            hs = [torch.randn(length, hidden).to(dtype) for _ in range(4)]
            digest = formats.write_sample(tmp_path / "d.pt", torch.arange(length), hs, torch.ones(length))
            bound = states.sample_bytes(length, hidden, 4, hs[0].element_size())
            assert bound - states.FILE_OVERHEAD < digest.bytes <= bound, (length, hidden, digest.bytes)


def test_plan_keeps_held_out_always_and_train_samples_only_in_hybrid():
    """online keeps the held-out states only; hybrid also keeps training samples in index order while a
    window of at least the largest training sample and 1/8 of the rest stays free; kept + window = budget."""
    sizes = [100] * 10
    train, held = list(range(8)), [8, 9]
    online = states.plan_states("online", 1000, sizes, train, held)
    assert online.keep == {8, 9} and online.kept_bytes == 200 and online.window == 800
    hybrid = states.plan_states("hybrid", 1000, sizes, train, held)
    assert hybrid.keep == {8, 9, 0, 1, 2, 3, 4, 5, 6} and hybrid.kept_bytes + hybrid.window == 1000
    assert hybrid.window >= max(100, (1000 - 200) // states.WINDOW_SHARE)
    big = states.plan_states("hybrid", 10_000, sizes, train, held)
    assert big.keep == set(range(10)) and big.record()["kept"] == list(range(10))


def test_plan_refuses_a_budget_without_room_for_the_held_out_and_one_sample():
    """The smallest budget that can train is named in the one-line refusal."""
    with pytest.raises(StageError, match="give at least 300 bytes"):
        states.plan_states("online", 299, [100] * 4, [0, 1], [2, 3])
    assert states.plan_states("online", 300, [100] * 4, [0, 1], [2, 3]).window == 100


def test_production_order_follows_the_trainer_and_skips_what_is_kept():
    """Each epoch's batches in order, the held-out after the first epoch's, a kept sample only once, a
    resumed epoch from its checkpointed step, kept files on disk never again."""
    train = [10, 11, 12, 13]  # dataset index -> sample index
    epochs = [[[0, 1], [2, 3]], [[3, 2], [1, 0]]]
    keep = frozenset({12, 20})
    assert states.production_order(epochs, 0, train, [20], keep, frozenset()) == [
        10, 11, 12, 13, 20, 13, 11, 10,
    ]  # fmt: skip
    assert states.production_order(epochs, 1, train, [20], keep, frozenset({12, 20})) == [13, 13, 11, 10]
    # kept 12 lost while its step is already trained: made at the end, so the run ends with every kept file
    assert states.production_order(epochs[1:], 2, train, [20], keep, frozenset({20})) == [12]
    assert states.production_order([], 0, train, [20], keep, frozenset()) == [20, 12]


def test_chunks_follow_extracts_batch_rule_and_the_room():
    """A forward takes samples in order while batch x longest <= max tokens, size <= max size, bytes <=
    room; one at least, whatever its size."""
    lengths, sizes = [10, 30, 20, 5], [1, 3, 2, 1]
    assert states.next_chunk([0, 1, 2, 3], 0, lengths, sizes, 1000, 64, 100) == 4
    assert states.next_chunk([0, 1, 2, 3], 0, lengths, sizes, 60, 64, 100) == 2  # 3 x 30 > 60
    assert states.next_chunk([0, 1, 2, 3], 0, lengths, sizes, 1000, 3, 100) == 3
    assert states.next_chunk([0, 1, 2, 3], 0, lengths, sizes, 1000, 64, 4) == 2
    assert states.next_chunk([0, 1, 2, 3], 1, lengths, sizes, 1000, 64, 1) == 1
    assert states.next_chunk([0, 1, 0, 2], 0, lengths, sizes, 1000, 64, 100) == 2  # 0 again: one file each


class _Prepared:
    """The prepared rows the producer reads: ids, mask and lengths."""

    def __init__(self, lengths):
        self._lengths = np.asarray(lengths)

    def lengths(self):
        return self._lengths

    def ids(self, i):
        return torch.arange(int(self._lengths[i]))

    def mask(self, i):
        return np.ones(int(self._lengths[i]), dtype=bool)


class _Backend:
    name = "fake"

    def capture(self, seqs):
        return [[torch.zeros(len(s), 4)] for s in seqs]


def test_a_sample_read_in_two_epochs_is_written_again_only_once_its_first_copy_is_read(tmp_path):
    """A transient sample that the trainer reads at the end of one epoch and early in the next one, the
    producer far enough ahead to reach both: the second copy waits until the first is read (deleted), so
    that the reader of the first does not delete the second (the trainer would wait for it forever)."""
    lengths = [8, 8, 8]
    sizes = [states.sample_bytes(t, 4, 1, 4) for t in lengths]
    plan = states.StatesPlan("online", 10**9, frozenset(), 0, 10**9)
    schedule = states.Schedule((0, 1, 0, 2), plan, tuple(sizes), frozenset(), 0, 4, 1, 1000, 64)
    assert states.Schedule.from_record(json.loads(json.dumps(schedule.record()))) == schedule
    producer = states.Producer(_Backend(), tmp_path, _Prepared(lengths), schedule).start()
    try:
        deadline = time.monotonic() + 10
        while producer.stats.samples < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert producer.stats.samples == 2  # 0 and 1 written; the second 0 waits for the first's reader
        formats.data_file(tmp_path, 0).unlink()  # the trainer read the first 0
        states.wait_for(formats.data_file(tmp_path, 2), tmp_path, timeout=10)
        assert formats.data_file(tmp_path, 0).exists() and producer.stats.samples == 4
    finally:
        producer.stop()


def test_a_reader_waiting_for_a_file_learns_why_it_will_not_come(tmp_path):
    """The trainer's wait for a state ends in one line when the producer failed (its FAILED file, or the
    readers' shared flag: a full disk may leave no file) or finished without it, instead of hanging; a file
    that appears ends it at once."""
    target = formats.data_file(tmp_path, 3)
    (tmp_path / states.FAILED).write_text("OSError: disk full\n")
    with pytest.raises(StageError, match="producer failed: OSError: disk full"):
        states.wait_for(target, tmp_path)
    (tmp_path / states.FAILED).unlink()
    (tmp_path / states.DONE).write_text("done\n")
    with pytest.raises(StageError, match="did not make it"):
        states.wait_for(target, tmp_path)
    (tmp_path / states.DONE).unlink()
    flag = multiprocessing.get_context("spawn").RawValue("b", 0)  # a loader worker's view, no file written
    threading.Timer(0.1, setattr, args=(flag, "value", 1)).start()
    with pytest.raises(StageError, match="producer failed"):
        states.wait_for(target, tmp_path, timeout=10, failed_flag=flag)
    threading.Timer(0.05, target.write_bytes, args=(b"x",)).start()
    states.wait_for(target, tmp_path, timeout=10)
    with pytest.raises(StageError, match="did not appear"):
        states.wait_for(formats.data_file(tmp_path, 4), tmp_path, timeout=0.05)


BEATING = """
import sys, time
from pathlib import Path
from pipeline.train import states
with states.Heartbeat(Path(sys.argv[1]), period=0.05):
    print("beating", flush=True)
    time.sleep(600)
"""


def test_a_reader_ends_its_wait_once_rank0s_process_is_gone(tmp_path):
    """Rank 0 (a real process here) beats: a reader keeps waiting however long. Stopped (SIGSTOP), it is
    silent but still there: the reader keeps waiting. SIGKILLed: the reader ends after ``stale_s`` of silence
    in one line naming the gone pid, and marks the run failed so that every other reader ends at once in the
    same words. An absent heartbeat (rank 0 not there yet, a run of an older version) says nothing."""
    import subprocess
    import sys

    from tests.conftest import REPO

    target = formats.data_file(tmp_path, 3)
    with pytest.raises(StageError, match="did not appear"):  # no heartbeat file: no verdict from it
        states.wait_for(target, tmp_path, timeout=0.5, stale_s=0.05)
    rank0 = subprocess.Popen(
        [sys.executable, "-c", BEATING, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert rank0.stdout.readline().strip() == "beating"
        with pytest.raises(StageError, match="did not appear"):  # 2 s of waiting, 0.3 s stale_s
            states.wait_for(target, tmp_path, timeout=2.0, stale_s=0.3)
        rank0.send_signal(signal.SIGSTOP)
        with pytest.raises(StageError, match="did not appear"):  # silent, and there
            states.wait_for(target, tmp_path, timeout=2.0, stale_s=0.3)
        rank0.kill()
        rank0.wait(timeout=30)
        t0 = time.monotonic()
        with pytest.raises(StageError) as err:
            states.wait_for(target, tmp_path, timeout=30, stale_s=0.5)
        assert 0.5 <= time.monotonic() - t0 < 10
        message = str(err.value)
        assert message.startswith(
            f"the states producer failed: {states.ORPHANED} (its process {rank0.pid} is gone"
        )
        assert "data_3.pt" in message and "--resume" in message and "\n" not in message
        assert (tmp_path / states.FAILED).read_text().strip() in message
        with pytest.raises(StageError) as again:  # another reader: at once, the same line
            states.wait_for(formats.data_file(tmp_path, 4), tmp_path, timeout=0.05)
        assert str(again.value) == message
    finally:
        rank0.kill()
        states.clear_failure(tmp_path)


@pytest.mark.parametrize("where", ["another host", "another pid namespace"])
def test_a_heartbeat_of_another_host_is_judged_by_its_silence_alone(tmp_path, monkeypatch, where):
    """A states dir shared with rank 0 on another host, or in another container of this one (another pid
    namespace: pid 1 there is not this one's init), or written by a version that named no process: no process
    to ask, so ``STALE_REMOTE_S`` of silence decides, and the line says so."""
    import json
    import socket

    host = "another-host" if where == "another host" else socket.gethostname()
    owner = {"pid": 1, "started": 0.0, "host": host, "pids": "pid:[1]"}
    (tmp_path / states.ALIVE).write_text(json.dumps(owner) + "\n")
    monkeypatch.setattr(states, "STALE_REMOTE_S", 0.8)
    target = formats.data_file(tmp_path, 0)
    try:
        with pytest.raises(StageError, match="did not appear"):  # past stale_s, short of the remote bound
            states.wait_for(target, tmp_path, timeout=0.5, stale_s=0.1)
        t0 = time.monotonic()
        with pytest.raises(StageError, match=rf"unmoved for \d+ s, rank 0 on host {host} not asked"):
            states.wait_for(target, tmp_path, timeout=30, stale_s=0.1)
        assert 0.8 <= time.monotonic() - t0 < 10
    finally:
        states.clear_failure(tmp_path)


def test_a_producer_that_fails_after_the_last_read_ends_the_run_in_the_readers_words(tmp_path):
    """A producer's error that surfaces only when the trainer is done (nothing was left to wait for: a
    producer process killed once every state was made) ends the run in the same one line as a reader that
    waited for it ("the states producer failed: ..."), not in the producer's bare words."""
    from types import SimpleNamespace

    from pipeline.train import produced

    class Killed(_Backend):
        def capture(self, seqs):
            raise StageError("its process ended with exit code -9 and no report")

    plan = states.StatesPlan("online", 10**9, frozenset(), 0, 10**9)
    schedule = states.Schedule((0,), plan, (states.sample_bytes(8, 4, 1, 4),), frozenset(), 0, 4, 1, 1000, 64)
    producer = states.Producer(Killed(), tmp_path, _Prepared([8]), schedule).start()
    try:
        deadline = time.monotonic() + 10
        while producer.running and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(StageError) as err:
            produced.finish(SimpleNamespace(data=tmp_path), None, producer, None)
    finally:
        states.clear_failure(tmp_path)
    assert str(err.value) == "the states producer failed: its process ended with exit code -9 and no report"


def test_loader_workers_wait_for_produced_files_read_and_delete_them(tmp_path):
    """The produced set's loader in workers forked by the fork server: a batch whose files come later is
    read once they come, the transient ones deleted by the worker that read them, the kept one left; the
    workers' waits are summed where the trainer reports them."""
    from pipeline.train.data import READER_START, make_loader
    from pipeline.train.datasets import ProducedDataset

    lengths = {i: 6 + i for i in range(4)}
    formats.write_sample_lengths(tmp_path, lengths)
    files = [formats.data_file(tmp_path, i) for i in range(4)]

    def write(i: int) -> None:
        n = lengths[i]
        hidden = [torch.full((n, 8), float(i)) for _ in range(4)]
        formats.write_sample(files[i], torch.arange(n), hidden, torch.ones(n, dtype=torch.int64))

    dataset = ProducedDataset(files, 64, torch.float32, frozenset(), READER_START)
    loader = make_loader(
        files, max_len=64, hidden_size=8, world_size=1, rank=0, seed=0, workers=2, pin_memory=False,
        dataset=dataset, start=READER_START,
    )  # fmt: skip
    order = [int(i) for batch in loader.batch_sampler for i in batch]  # what the loader will read, in order
    dataset.transient = frozenset(files[i].name for i in order[:-1])  # the last one read is kept

    def produce():  # the first file read at once; the others 0.5 s after a worker has read (deleted) it
        write(order[0])
        deadline = time.monotonic() + 60
        while files[order[0]].exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        for i in order[1:]:
            write(i)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        batches = list(loader)
    finally:
        producer.join()
    assert sum(int(b["loss_mask"].sum()) for b in batches) == sum(lengths.values()) - 4  # shifted by one
    assert [files[i].exists() for i in order] == [False, False, False, True]  # transient ones read, deleted
    assert dataset.wait_seconds >= 0.5  # the workers' waits, seen in this process


READER_WAITING = """
import sys, torch
from pathlib import Path
from pipeline.ondisk import formats
from pipeline.train.data import READER_START, make_loader, start_reader_server
from pipeline.train.datasets import ProducedDataset
start_reader_server()  # as the stage does: the worker starts with its imports done
d = Path(sys.argv[1])
formats.write_sample_lengths(d, {0: 8})
files = [formats.data_file(d, 0)]
dataset = ProducedDataset(files, 64, torch.float32, frozenset(), READER_START)
loader = make_loader(files, max_len=64, hidden_size=8, world_size=1, rank=0, seed=0, workers=1,
                     pin_memory=False, dataset=dataset, start=READER_START)
print("reading", flush=True)
next(iter(loader))  # data_0.pt never comes: the worker waits for it
"""


def test_a_loader_worker_waiting_for_a_file_ends_with_its_killed_trainer(tmp_path):
    """A trainer SIGKILLed while its loader worker waits for a state that its producer (killed with it) will
    never write: the worker, and every other process the trainer started, is gone within seconds, not
    left polling for that file for ever."""
    import subprocess
    import sys

    import psutil

    from tests.conftest import REPO

    trainer = subprocess.Popen(
        [sys.executable, "-c", READER_WAITING, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    me = psutil.Process(trainer.pid)

    def forked() -> list[psutil.Process]:  # the workers: children of the fork server, the trainer's child
        return [p for p in me.children(recursive=True) if p.ppid() != me.pid]

    try:
        assert trainer.stdout.readline().strip() == "reading"
        deadline = time.monotonic() + 60
        while not forked() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert forked(), [p.cmdline() for p in me.children(recursive=True)]
        time.sleep(2.0)  # the worker, forked with its imports done, is inside its wait for data_0.pt
        started = [p.pid for p in me.children(recursive=True)]  # the server, the worker, the resource tracker
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
    assert not still_alive(started, within=20), "a loader worker outlived its killed trainer"


def test_replayed_batches_are_the_loaders_own(tmp_path):
    """The producer's order is the batches speculators' sampler gives the trainer, epoch by epoch."""
    from pipeline.train.data import make_loader

    lengths = {i: 20 + (i * 37) % 90 for i in range(30)}
    formats.write_sample_lengths(tmp_path, lengths)
    files = [formats.data_file(tmp_path, i) for i in range(30)]
    loader = make_loader(
        files, max_len=200, hidden_size=8, world_size=1, rank=0, seed=3, workers=0, pin_memory=False
    )
    for epoch in range(3):
        loader.batch_sampler.set_epoch(epoch)
        real = [[int(i) for i in b] for b in loader.batch_sampler]
        assert states.epoch_batches(loader.dataset.approx_lengths, 200, 3, epoch) == real
    assert states.epoch_batches(loader.dataset.approx_lengths, 200, 3, 0) != states.epoch_batches(
        loader.dataset.approx_lengths, 200, 3, 1
    )


# ---------------------------------------------------------------- on the tiny Llama, real stages
# (the fixtures stage_inputs and offline: tests/train/conftest.py)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_online_gives_the_offline_draft_bit_for_bit(stage_inputs, offline, tmp_path, workers):
    """One sample per forward on both sides: online training writes the same bytes as extract for every
    state it keeps, and ends with the same weights, losses and acceptance as offline training on the same
    data, steps and seed; its state files never exceed the budget; what it keeps passes `pipeline verify`.
    With loader workers (forked by the fork server: the producer's thread runs in the trainer) reading and
    deleting the files: the same."""
    from pipeline import verify
    from pipeline.train.stage import run

    ref = offline["cfg"]
    budget = budget_for(ref.data, held=8)
    total = sum(p.stat().st_size for p in ref.data.glob("data_*.pt"))
    assert int(budget) < 0.75 * total  # the whole set would not fit
    cfg = states_config(
        stage_inputs,
        tmp_path / "states",
        tmp_path / "out",
        states_mode="online",
        states_budget=budget,
        states_max_batch_size=1,
        num_workers=workers,
    )
    summary = run(cfg, log=lambda m: None)
    st = summary["train"]["states"]
    assert str(cfg.data) not in states._READER_FLAGS  # the run's readers' flags went with its producer
    assert not (cfg.data / states.ALIVE).exists()  # rank 0's heartbeat went with the finished run
    assert summary["train"]["phase_seconds"]["states_finish"] >= 0  # a produced run's own phase
    # held-out 4 and the 4 training samples the acceptance baseline reads are kept: produced once
    assert st["peak_bytes"] <= int(budget) and st["produced_samples"] == 4 + 12 + 8 * (EPOCHS - 1)
    kept = formats.existing_data_indices(cfg.data)
    record = json.loads((cfg.out / "train_config.json").read_text())
    expected = {*record["eval_files"], *record["train_files"][:4]}
    assert {formats.data_file(cfg.data, i).name for i in kept} == expected and len(kept) == 8
    for i in kept:
        assert formats.data_file(cfg.data, i).read_bytes() == formats.data_file(ref.data, i).read_bytes()
    for epoch in range(EPOCHS):
        a, b = checkpoint_weights(ref.out, epoch), checkpoint_weights(cfg.out, epoch)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert train_losses(cfg.out) == train_losses(ref.out)
    assert summary["eval"]["draft"] == offline["summary"]["eval"]["draft"]
    result = verify.verify(verify.VerifyConfig(path=cfg.data))
    assert not [c for c in result.checks if c.status == "fail"], result.checks


@pytest.mark.slow
def test_hybrid_reuses_what_it_keeps_and_stays_close_to_offline(stage_inputs, offline, tmp_path):
    """hybrid with batched forwards: the kept training samples are produced once, the others each epoch;
    the draft differs from offline only by the batch composition's rounding of the states (fp32, ~3e-7):
    final weights within 1e-6 and the last loss within 1e-5 relative (seen: 7.1e-8, 1.2e-6), acceptance at
    k=3 within the issue's 0.05 (seen: equal). A file it does not keep, or a kept one missing, fails
    verify."""
    from pipeline import verify
    from pipeline.train.stage import run

    ref = offline["cfg"]
    budget = budget_for(ref.data, held=11)  # room for about 3 more training samples
    cfg = states_config(
        stage_inputs, tmp_path / "states", tmp_path / "out", states_mode="hybrid", states_budget=budget
    )
    summary = run(cfg, log=lambda m: None)
    st = summary["train"]["states"]
    kept = formats.existing_data_indices(cfg.data)
    kept_train = len(kept) - 4  # the 4 the acceptance baseline reads among them
    assert 4 < kept_train < 12, kept
    assert st["produced_samples"] == 4 + 12 + (12 - kept_train) and st["peak_bytes"] <= int(budget)
    a, b = checkpoint_weights(ref.out, EPOCHS - 1), checkpoint_weights(cfg.out, EPOCHS - 1)
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst < 1e-6, worst
    la, lb = train_losses(ref.out)[-1], train_losses(cfg.out)[-1]
    assert abs(la - lb) <= 1e-5 * abs(la), (la, lb)
    ours, theirs = (r["eval"]["draft"]["acceptance_length"] for r in (summary, offline["summary"]))
    assert abs(ours - theirs) <= 0.05, (ours, theirs)
    assert not [c for c in verify.verify(verify.VerifyConfig(path=cfg.data)).checks if c.status == "fail"]
    transient = next(i for i in range(SAMPLES) if i not in kept)
    formats.data_file(cfg.data, transient).write_bytes(formats.data_file(cfg.data, kept[0]).read_bytes())
    failed = {c.name for c in verify.verify(verify.VerifyConfig(path=cfg.data)).checks if c.status == "fail"}
    assert "contiguity" in failed  # a file the run does not keep
    formats.data_file(cfg.data, transient).unlink()
    formats.data_file(cfg.data, kept[0]).unlink()
    failed = {c.name for c in verify.verify(verify.VerifyConfig(path=cfg.data)).checks if c.status == "fail"}
    assert {"contiguity", "count"} <= failed  # a kept file missing


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume(stage_inputs, offline, tmp_path):
    """A hybrid `pipeline train` process SIGKILLed in its second epoch, then resumed: the resumed process
    starts at the last checkpointed step (none before it trained again, metrics.jsonl has every step once),
    no partial or transient state file is left, the kept ones are reused, the state files never exceeded
    the budget, and the draft equals the uninterrupted offline one bit for bit (one sample per forward).
    Its two loader workers (forked by the fork server, they read and delete the states) end with it."""
    ref = offline["cfg"]
    budget = budget_for(ref.data, held=8)
    cfg = states_config(
        stage_inputs,
        tmp_path / "states",
        tmp_path / "out",
        states_mode="hybrid",
        states_budget=str(int(budget) * 2),
        states_max_batch_size=1,
        checkpoint_steps=1,
        num_workers=2,
    )
    steps = offline["summary"]["train"]["steps_per_epoch"]
    result = interrupt_then_resume(
        cfg, [(signal.SIGKILL, steps + 2)], timeout=300, module="tests.train.held_train", hold=True
    )
    (killed,) = result["stops"]
    assert len(killed["children"]) >= 2  # the loader's workers (and their resource tracker) were running
    assert not still_alive(killed["children"], within=30), "a loader worker outlived the killed trainer"
    assert steps + 2 <= killed["rows"] < EPOCHS * steps, (
        f"kill landed outside epoch 1 ({killed['rows']} steps)"
    )
    assert len(killed["kept"]) > 4  # the kill came after epoch 1 made the hybrid cache
    assert killed["local_step"] > 0 and killed["committed"] >= killed["rows"] - 2
    summary = assert_recovered(cfg, result, EPOCHS * steps)
    # only the transient samples of the steps after the checkpoint are produced again; kept files are reused
    assert summary["train"]["states"]["produced_samples"] < 12
    for epoch in range(EPOCHS):
        a, b = checkpoint_weights(ref.out, epoch), checkpoint_weights(cfg.out, epoch)
        assert all(torch.equal(a[k], b[k]) for k in a), epoch
    assert np.isclose(train_losses(cfg.out)[-1], train_losses(ref.out)[-1], rtol=0, atol=0)


def _one_line_exit_2(proc, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_inputs_are_one_line_and_touch_nothing(stage_inputs, offline, tmp_path, warm_pipeline):
    """No budget, a budget too small, a finished extract set as the states dir, online-only flags offline,
    loader workers beside the producer, a memory share out of range or for an hf producer: each one line,
    exit 2, and the extract set is left as it was."""
    ref = offline["cfg"]
    cfg = states_config(
        stage_inputs, tmp_path / "s", tmp_path / "o", states_mode="online", states_budget="1G"
    )
    base = cli_args(cfg)
    no_budget = [a for a in base if a not in ("--states-budget", "1G")]
    _one_line_exit_2(warm_pipeline(*no_budget), "needs --states-budget")
    small = [("10k" if a == "1G" else a) for a in base]
    _one_line_exit_2(warm_pipeline(*small), "cannot hold", "give at least")
    assert not (tmp_path / "s").exists() and not (tmp_path / "o").exists()
    before = sorted((p.name, p.stat().st_mtime_ns) for p in ref.data.iterdir())
    on_extract = [(str(ref.data) if a == str(tmp_path / "s") else a) for a in base]
    _one_line_exit_2(warm_pipeline(*on_extract, "--overwrite"), "finished hidden-states set")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in ref.data.iterdir()) == before
    offline_budget = [
        "train", "--data", str(ref.data), "--verifier", str(stage_inputs["verifier"]), "--out",
        str(tmp_path / "o2"), "--states-budget", "1G",
    ]  # fmt: skip
    _one_line_exit_2(warm_pipeline(*offline_budget), "only with --states-mode online or hybrid")
    # a memory share holds a vllm engine: refused for an hf producer, asked or chosen by auto (this CPU)
    _one_line_exit_2(warm_pipeline(*base, "--states-memory-share", "1.5"), "between 0 and 1 (exclusive)")
    asked_hf = [*base, "--states-backend", "hf", "--states-memory-share", "0.5"]
    _one_line_exit_2(
        warm_pipeline(*asked_hf), "--states-memory-share 0.5 is the vllm producer's", "hf backend"
    )
    auto_hf = [*base, "--states-memory-share", "0.5"]
    _one_line_exit_2(warm_pipeline(*auto_hf), "the hf backend produces here")
    # only the vllm producer's place is chosen
    hf_process = [*base, "--states-backend", "hf", "--states-producer", "process"]
    _one_line_exit_2(warm_pipeline(*hf_process), "--states-producer process with --states-backend hf")
    _one_line_exit_2(
        warm_pipeline(*offline_budget[:-2], "--states-producer", "thread"),
        "--states-producer: only with --states-mode online or hybrid",
    )
    assert not (tmp_path / "s").exists() and not (tmp_path / "o").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
@pytest.mark.parametrize("workers", [0, 2])
def test_a_full_disk_under_the_producer_ends_the_run_in_one_line(
    stage_inputs, small_disk, tmp_path, warm_pipeline, workers
):
    """The disk fills before the budget does: the trainer, waiting for a state, ends the run with the
    producer's cause in one line, exit 2, instead of hanging; no partial file is left, every file there is
    complete. With loader workers (other processes, for which the full disk may leave no FAILED file) too."""
    cfg = states_config(
        stage_inputs,
        small_disk,
        tmp_path / "out",
        states_mode="online",
        states_budget="50M",
        num_workers=workers,
    )
    proc = warm_pipeline(*cli_args(cfg), timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert last.startswith("error: the states producer failed: writing states to") and os.strerror(28) in last
    assert "--resume" in last
    assert not list(small_disk.glob(".*partial"))
    for i in formats.existing_data_indices(small_disk):
        formats.read_sample(formats.data_file(small_disk, i))
