"""Our hidden-state samples (``data_{i}.pt``) as speculators 0.9's trainer consumes them.

Owns the bridge between the on-disk contract of ``pipeline extract`` and speculators' data path: the
dataset of finished files (its ``BaseDataset`` classes live in pipeline/train/datasets.py: one sample per
index, the 3 auxiliary captured layers concatenated as the draft's input, the last captured layer as the
verifier's last hidden state, the loss mask), and the loader that packs samples with speculators'
``MultipackDistributedBatchSamplerV2`` and ``CollateFn`` after its EAGLE-3 ``shift_batch`` (token t+1 against
the states of token t). speculators 0.9's own dataset reads ``hs_{i}.safetensors`` + an Arrow dataset
instead; pipeline/interop.py converts between the two, losslessly
(``pipeline export-speculators`` / ``import-speculators``; docs/train.md says why data_{i}.pt stays).
"""

from __future__ import annotations

import functools
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.model.layers import NUM_CAPTURED


# How a produced run's loader workers start (online/hybrid: the trainer cannot fork once the producer's thread
# and CUDA context are live). A fork server is a fresh interpreter started once, which imports what a worker
# unpickles (speculators, hence transformers and torch's inductor: seconds per process) while the trainer
# loads; each worker is then forked from it, ready. Under ``spawn`` every worker paid those imports itself,
# the train loader's at its first batch and the validation loader's at the first validation.
READER_START = "forkserver"
READER_MODULES = ("pipeline.train.datasets", "speculators.models.eagle3.data", "speculators.train.data")
TRAINER_POLL_S = 0.5  # how often a produced loader's worker checks that its trainer lives


def start_reader_server() -> None:
    """Start the produced loaders' fork server now, its imports beside this process's work (a no-op once it
    runs). Its environment and ``sys.path`` are this process's at this moment."""
    if READER_START != "forkserver":  # bench/reader_start_bench.py's baseline sets "spawn"
        return
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(list(READER_MODULES))
    forkserver.ensure_running()


def end_with_trainer(pid: int, started: float, worker_id: int) -> None:
    """A produced loader's ``worker_init_fn``: a thread of the worker that ends it once the trainer (``pid``,
    created at ``started``) is gone. torch's own check is of the worker's parent, between reads: a worker
    forked by the fork server has the server for parent, and the server lives while any worker holds its
    pipe, so after a SIGKILL of the trainer both would stay for ever, idle or waiting for a file that the
    killed producer will never write."""
    import psutil

    def watch() -> None:
        while True:
            time.sleep(TRAINER_POLL_S)
            try:
                trainer = psutil.Process(pid)
                alive = (
                    abs(trainer.create_time() - started) < 1e-3 and trainer.status() != psutil.STATUS_ZOMBIE
                )
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                os._exit(1)

    threading.Thread(target=watch, name=f"end-with-trainer-{worker_id}", daemon=True).start()


def sample_dataset(files: list[Path], max_len: int, hidden_states_dtype: torch.dtype = torch.float32):
    """The dataset of ``files`` (speculators' ``BaseDataset``), unshifted: index i = file i."""
    from pipeline.train.datasets import SampleFileDataset

    return SampleFileDataset(files, max_len, hidden_states_dtype)


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
    start: str | None = None,
):
    """Packed batches of ``files`` for one data-parallel rank, speculators' sampler and collate; the hidden
    states in ``dtype`` (the trainer's autocast dtype: pipeline/train/stage.py ``states_dtype``). ``dataset``:
    another dataset over the same files (pipeline/train/datasets.py's ``ProducedDataset``, which waits for
    produced ones). ``start``: how the loader's workers start (a multiprocessing start method; None: fork)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from torch.utils.data import DataLoader

    dataset = sample_dataset(files, max_len, dtype) if dataset is None else dataset
    init = None
    if start is not None and workers > 0:  # workers not forked from this process: they watch it themselves
        import psutil

        init = functools.partial(end_with_trainer, os.getpid(), psutil.Process().create_time())
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
        multiprocessing_context=start if workers > 0 else None,
        worker_init_fn=init,
    )


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (all GPUs too): data order and initialisation repeat."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
