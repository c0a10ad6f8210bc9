"""The trainer's datasets over ``data_{i}.pt`` files (speculators 0.9's ``BaseDataset``), at module level.

Owns two classes:

* ``SampleFileDataset``: finished files in speculators' sample layout, before its EAGLE-3 shift (the 3
  auxiliary captured layers concatenated as the draft's input, the last one as the verifier's last hidden
  state, the loss mask);
* ``ProducedDataset``: files that the states producer is still writing (``pipeline train --states-mode
  online|hybrid``): each read waits for its file (pipeline/train/states.py ``wait_for``), and a transient
  file is read whole and deleted, which is what lets the producer write the next one within the budget.

They live here, importable by name, because a produced run's loader worker unpickles its dataset: it cannot
fork from the trainer (the producer's thread and CUDA context are live there) and forks from a fork server
instead (pipeline/train/data.py ``READER_START``), and a class defined inside a function cannot be
unpickled. The time readers wait is summed in a shared value, so the trainer's summary sees the waits of
every worker. This module imports speculators: import it lazily.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import torch
from speculators.train.data import BaseDataset

from pipeline.ondisk import formats


class SampleFileDataset(BaseDataset):
    """``data_{i}.pt`` files in speculators' sample layout (before its shift)."""

    def __init__(self, files: list[Path], max_len: int, hidden_states_dtype: torch.dtype = torch.float32):
        self.files = [Path(f) for f in files]
        super().__init__(max_len, hidden_states_dtype)

    def __len__(self) -> int:
        return len(self.files)

    def _compute_approx_lengths(self) -> list[int]:
        known = formats.read_sample_lengths(self.files[0].parent) if self.files else {}
        lengths = []
        for f in self.files:
            index = int(f.stem.rsplit("_", 1)[-1])
            if index not in known:
                known[index] = int(formats.read_sample(f, mmap=True)["input_ids"].shape[0])
            lengths.append(known[index])
        return lengths

    def _load(self, index: int) -> dict:
        """File ``index`` as ``formats.read_sample`` gives it."""
        return formats.read_sample(self.files[index], mmap=True)

    def _get_raw_data(self, index: int) -> dict:
        sample = self._load(index)
        layers = sample["hidden_states"]
        dtype = self.hidden_states_dtype
        return {
            "hidden_states": torch.cat([h.to(dtype) for h in layers[:-1]], dim=-1),
            "input_ids": sample["input_ids"].long(),
            "verifier_last_hidden_states": layers[-1].to(dtype),
            "loss_mask": sample["loss_mask"].long(),
        }


class ProducedDataset(SampleFileDataset):
    """Files being produced: a read waits for its file; a file named in ``transient`` is read whole and
    deleted. ``wait_seconds``: what every reader of this dataset (the trainer's thread or its loader
    workers) waited for files, summed. A failed producer sets a shared flag, so that no worker waits for a
    file that will not come (on a full disk the producer's FAILED file may not be written either)."""

    def __init__(
        self, files: list[Path], max_len: int, dtype: torch.dtype, transient: frozenset[str], start: str
    ):
        from pipeline.train.states import register_reader

        self.transient = transient
        # values of the workers' start context (``start``, a multiprocessing start method): picklable into a
        # worker, shared with it
        context = multiprocessing.get_context(start)
        self._waited = context.Value("d", 0.0)
        self._failed = context.RawValue("b", 0)  # set by the producer when it fails
        if files:
            register_reader(Path(files[0]).parent, self._failed)
        super().__init__(files, max_len, dtype)

    @property
    def wait_seconds(self) -> float:
        return self._waited.value

    def _load(self, index: int) -> dict:
        from pipeline.train.states import wait_for

        path = self.files[index]
        t0 = time.perf_counter()
        wait_for(path, path.parent, failed_flag=self._failed)
        with self._waited.get_lock():
            self._waited.value += time.perf_counter() - t0
        if path.name not in self.transient:
            return formats.read_sample(path, mmap=True)
        sample = formats.read_sample(path)
        path.unlink()
        return sample
