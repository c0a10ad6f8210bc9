"""Our hidden-state samples (``data_{i}.pt``) as speculators 0.9's trainer consumes them.

Owns the bridge between the on-disk contract of ``pipeline extract`` and speculators' data path: a
``BaseDataset`` that reads one sample per index (the 3 auxiliary captured layers concatenated as the
draft's input, the last captured layer as the verifier's last hidden state, the loss mask), and the loader
that packs samples with speculators' ``MultipackDistributedBatchSamplerV2`` and ``CollateFn`` after its
EAGLE-3 ``shift_batch`` (token t+1 against the states of token t). speculators 0.9's own dataset reads
``hs_{i}.safetensors`` + an Arrow dataset instead; pipeline/interop.py converts between the two, losslessly
(``pipeline export-speculators`` / ``import-speculators``; docs/train.md says why data_{i}.pt stays).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from pipeline.ondisk import formats
from pipeline.model.layers import NUM_CAPTURED


def _dataset_class():
    from speculators.train.data import BaseDataset

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
                lengths.append(
                    known[index]
                    if index in known
                    else int(formats.read_sample(f, mmap=True)["input_ids"].shape[0])
                )
            return lengths

        def _load(self, index: int) -> dict:
            """File ``index`` as ``formats.read_sample`` gives it (pipeline/train/states.py waits for it
            first)."""
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

    return SampleFileDataset


def sample_dataset(files: list[Path], max_len: int, hidden_states_dtype: torch.dtype = torch.float32):
    """The dataset of ``files`` (speculators' ``BaseDataset``), unshifted: index i = file i."""
    return _dataset_class()(files, max_len, hidden_states_dtype)


def make_loader(
    files: list[Path],
    *,
    max_len: int,
    hidden_size: int,
    world_size: int,
    rank: int,
    seed: int,
    workers: int,
    pin_memory: bool,
    dtype: torch.dtype = torch.float32,
    dataset=None,
):
    """Packed batches of ``files`` for one data-parallel rank, speculators' sampler and collate; the hidden
    states in ``dtype`` (the trainer's autocast dtype: pipeline/train/stage.py ``states_dtype``). ``dataset``:
    another dataset over the same files (pipeline/train/states.py's, which waits for produced ones)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from torch.utils.data import DataLoader

    dataset = sample_dataset(files, max_len, dtype) if dataset is None else dataset
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=max_len,
        lengths=dataset.approx_lengths,
        num_replicas=world_size,
        rank=rank,
        seed=seed,
    )
    collate = CollateFn(
        max_len, hidden_size, num_target_layers=NUM_CAPTURED - 1, dtype=dtype, preprocess=shift_batch
    )
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        collate_fn=collate,
        persistent_workers=workers > 0,
    )


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (all GPUs too): data order and initialisation repeat."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
