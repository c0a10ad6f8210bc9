"""The extract writer: waits for each batch's copies before writing, and bounds what waits in bytes."""

from __future__ import annotations

import threading
import time

import torch

from pipeline.ondisk import formats
from pipeline.extract.writer import Sample, Writer


def _item(i: int, states: list[torch.Tensor], ready=lambda: None):
    t = states[0].shape[0]
    return Sample(i, torch.arange(t), states, torch.ones(t, dtype=torch.int64), ready)


def test_writer_waits_for_ready_before_writing(tmp_path):
    """A sample is written only after its batch's ready() returned: the file holds the copied values,
    not what the host buffer held before the copy finished."""
    states = [torch.zeros(5, 3) for _ in range(2)]
    copied = threading.Event()

    def ready():  # stands in for the device-to-host copy finishing a little later
        time.sleep(0.2)
        for h in states:
            h.fill_(7.0)
        copied.set()

    w = Writer(tmp_path, threads=2)
    w.put([_item(0, states, ready)])
    w.close()
    assert copied.is_set()
    saved = formats.read_sample(formats.data_file(tmp_path, 0))
    assert all(torch.equal(h, torch.full((5, 3), 7.0)) for h in saved["hidden_states"])


def test_put_blocks_while_too_many_bytes_wait_and_always_admits_one_batch(tmp_path):
    """With a bound of one sample's bytes, a batch larger than the bound passes when nothing waits, and the
    next put waits until the writer has drained it; the wait is reported."""
    gate = threading.Event()
    big = [torch.ones(64, 64) for _ in range(2)]  # 32 KiB
    w = Writer(tmp_path, threads=1, max_pending_bytes=1024)
    w.put([_item(0, big, gate.wait), _item(1, [h.clone() for h in big])])  # 2x over the bound: admitted
    done = threading.Event()

    def second():
        w.put([_item(2, [h.clone() for h in big])])
        done.set()

    t = threading.Thread(target=second)
    t.start()
    assert not done.wait(0.3), "put() must wait while the first batch is pending"
    gate.set()
    assert done.wait(10)
    t.join()
    w.close()
    assert formats.existing_data_indices(tmp_path) == [0, 1, 2]
    assert w.wait_seconds >= 0.25


def test_written_counts_files_on_disk_not_samples_queued(tmp_path):
    """The progress bar's count: a sample queued but not yet written (its copies not ready) is not
    counted, a written one is, and a failed write never is."""
    gate = threading.Event()
    w = Writer(tmp_path, threads=1)
    w.put([_item(0, [torch.zeros(4, 2)]), _item(1, [torch.zeros(4, 2)], gate.wait)])
    deadline = time.monotonic() + 10
    while w.written < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert w.written == 1 and formats.existing_data_indices(tmp_path) == [0]
    gate.set()
    w.close()
    assert w.written == 2

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # writing under a file fails
    w = Writer(blocked, threads=1)
    w.put([_item(0, [torch.zeros(4, 2)])])
    try:
        w.close()
    except Exception:  # noqa: BLE001 - the write error is re-raised; only the count matters here
        pass
    assert w.written == 0
