"""The producing side of a ``pipeline train --states-mode online|hybrid`` run, between its planning and its
training: what was planned (``Produced``: the prepared set, the states dir's description, the plan, the
backend and its options), where a vllm producer runs and with what share of GPU memory, and the producer's
start at the trainer's resume point and its finish with the run's figures.

Owns the glue only: the plan, the producer thread and the waiting dataset are pipeline/train/states.py's, a
torchrun job's producer process pipeline/train/producer_process.py's, the memory share's rule
pipeline/train/share.py's; the inputs are checked (``produced_inputs``) and the trainer run in
pipeline/train/stage.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import StageError
from pipeline.ondisk import formats
from pipeline.train.config import TrainConfig


@dataclass
class Produced:
    """An online or hybrid run's producing side, checked and planned (pipeline/train/states.py); the
    backend is loaded later, once the output is locked."""

    prepared: formats.PreparedSamples
    data_config: formats.DataConfig
    plan: object  # states.StatesPlan
    sizes: list[int]
    train: list[int]  # dataset index -> sample index
    held_out: list[int]
    backend_options: object  # BackendOptions
    backend: str  # hf | vllm: --states-backend, auto resolved
    backend_reason: str  # why (auto's one line, or "as asked")
    share_reason: str = ""  # the vllm producer's memory share and why (pipeline/train/share.py)
    # a torchrun job's vllm producer, in a process of its own: its GPUs (producer_process.Placement); None:
    # the producer is a thread of this process
    engine: object = None


def engine_placement(cfg: TrainConfig, backend: str, world_size: int):
    """Where a vllm producer's process runs (``producer_process.Placement``), or None where the producer is
    a thread of the trainer's process (the hf producer; the vllm one with ``--states-producer thread``,
    refused under torchrun, where an engine inside a rank hangs on the job's process group). A torchrun
    job's: ``producer_process.engine_placement``, the GPUs after the trainers', or theirs shared; refused in
    one line when too few are left. One process's: the GPUs the thread's engine would take (the first
    --states-tensor-parallel-size visible, all without it), shared when the trainer's --device is one of
    them. A process is the default: beside the trainer on the H200 it trained 1.39x faster than the thread
    (docs/benchmarks-history.md, 2026-12-05)."""
    from pipeline.backends.base import resolve_device, visible_device_count
    from pipeline.train import producer_process

    if backend != "vllm":
        return None
    if cfg.states_producer == "thread":
        if world_size > 1:
            raise StageError(
                "--states-producer thread under torchrun: a vllm engine inside a rank takes the job's "
                "process group and hangs; use --states-producer auto or process"
            )
        return None
    visible = producer_process.visible_gpu_ids(os.environ, visible_device_count())
    if world_size > 1:
        return producer_process.engine_placement(visible, world_size, cfg.states_tensor_parallel_size)
    if not visible:
        return producer_process.Placement(())
    gpus = visible[: cfg.states_tensor_parallel_size or len(visible)]
    trainer = resolve_device(cfg.device)
    shared = trainer.type == "cuda" and (trainer.index or 0) < len(gpus)
    return producer_process.Placement(tuple(gpus), shared=shared)


def memory_share(cfg: TrainConfig, backend: str, model_dir: Path, engine=None):
    """The vllm producer's memory share for this run (pipeline/train/share.py) from the visible GPUs: the
    engine on the first --states-tensor-parallel-size of them, the trainer on --device (in one process, the
    engine's a thread or a process); a torchrun job's engine (``engine``, its placement) on GPUs of its own,
    or over the trainers' (rank 0's on cuda:0)."""
    from pipeline.backends.base import resolve_device, visible_device_count
    from pipeline.backends.choice import gpu_memory_bytes, weights_bytes
    from pipeline.train.share import producer_share

    gpus = visible_device_count()
    trainer = resolve_device(cfg.device) if gpus else torch.device("cpu")
    trainer_gpu = (trainer.index or 0) if trainer.type == "cuda" else None
    engine_gpus = cfg.states_tensor_parallel_size or gpus
    if engine is not None:  # torchrun: rank r on cuda:r; the engine's own GPUs are none of the trainers'
        trainer_gpu = 0 if engine.shared else None
        engine_gpus = len(engine.gpus)
    sharing = backend == "vllm" and trainer_gpu is not None  # the facts are read only where they count
    return producer_share(
        cfg.states_memory_share,
        backend,
        trainer_gpu,
        engine_gpus,
        weights_bytes(model_dir) if sharing else None,
        gpu_memory_bytes() if sharing else None,
    )


def start(
    cfg: TrainConfig, produced: Produced, backend, train_loader, trainer, present, world_size: int, log
):
    """The producer of the epochs this invocation trains, from the trainer's resume point on: every rank's
    batches step by step (``states.epoch_batches``), a resumed epoch's checkpointed steps skipped on each."""
    from pipeline.train import states

    last = (
        cfg.epochs
        if cfg.stop_after_epochs is None
        else min(cfg.epochs, trainer.current_epoch + cfg.stop_after_epochs)
    )
    lengths = train_loader.dataset.approx_lengths
    epochs = [
        states.epoch_batches(lengths, cfg.max_len, cfg.seed, e, world_size)
        for e in range(trainer.current_epoch, last)
    ]
    first = trainer.resume_step * world_size  # each rank's checkpointed steps: world_size batches a step
    order = states.production_order(
        epochs, first, produced.train, produced.held_out, produced.plan.keep, present
    )
    directory = Path(cfg.data)
    present_bytes = sum(formats.data_file(directory, i).stat().st_size for i in present)
    log(
        f"states ({cfg.states_mode}): {len(order)} samples to produce with the {produced.backend} backend, "
        f"{len(produced.plan.keep)} kept ({len(present)} on disk already), budget "
        f"{produced.plan.budget:,} bytes"
    )
    schedule = states.Schedule(
        tuple(order),
        produced.plan,
        tuple(produced.sizes),
        present,
        present_bytes,
        hidden_size=produced.data_config.hidden_size,
        num_layers=len(produced.data_config.layer_ids),
        max_batch_tokens=cfg.states_max_batch_tokens,
        max_batch_size=cfg.states_max_batch_size,
    )
    if produced.engine is not None:  # the producer's process: the schedule goes there
        return backend.produce(directory, Path(cfg.prepared), schedule)
    return states.Producer(backend, directory, produced.prepared, schedule).start()


def finish(cfg: TrainConfig, produced: Produced, producer, train_loader) -> dict:
    """After training: no transient state left on disk, the kept files' records folded; the figures."""
    from pipeline.train import states

    directory = Path(cfg.data)
    try:
        unmade = producer.finish()  # the producer's error, if any, is the run's
    except Exception:
        # named as a reader names it: a producer that failed after the trainer's last read (its process
        # killed once every state was made) ends the run in the same one line as one that failed before
        failure = states.producer_failure(directory)
        if failure is None:
            raise
        raise failure from None
    unread = [i for i in formats.existing_data_indices(directory) if i not in produced.plan.keep]
    for i in unread:
        formats.data_file(directory, i).unlink()
    if unmade or unread:  # the producer's schedule and the trainer's reads disagreed
        raise StageError(
            f"states: {unmade} scheduled samples not produced and {len(unread)} produced but never read: "
            "the producer's order is not the trainer's (a bug; the draft is saved, the states dir holds only "
            "kept files)"
        )
    files = states.finish_states_dir(directory, produced.data_config)
    st = producer.stats
    return {
        "mode": cfg.states_mode,
        "producer": "thread" if produced.engine is None else "process",  # of rank 0's (producer_process)
        "budget_bytes": produced.plan.budget,
        "kept_samples": len(produced.plan.keep),
        "files_on_disk": files,
        "bytes_on_disk": states.state_file_bytes(directory),
        "peak_bytes": st.peak_bytes,
        "produced_samples": st.samples,
        "produced_tokens": st.tokens,
        "produced_bytes": st.bytes_written,
        "capture_seconds": round(st.capture_seconds, 3),
        "producer_room_wait_seconds": round(st.room_wait_seconds, 3),
        "trainer_wait_seconds": round(getattr(train_loader.dataset, "wait_seconds", 0.0), 3),
    }
