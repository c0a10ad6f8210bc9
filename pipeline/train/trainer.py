"""speculators 0.9's ``Trainer``, subclassed only for what the train stage needs and it lacks: any device (the
CPU included: its step timer and autocast assume an accelerator), full-precision checkpoints so that a
resumed run equals an uninterrupted one, each saved under a staging name and renamed in (a kill at any
instant leaves the old checkpoint or the new one whole: ``replace_checkpoint``, ``settle_checkpoints``),
checkpoints inside an epoch (``--checkpoint-steps``), stopping after N epochs of an invocation, and each
epoch's training, validation and checkpoint seconds. Also the step's forward arguments
(``get_trainer_kwargs``) and the per-step metrics file (``MetricsFile``). pipeline/train/stage.py builds and
runs it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import warnings
from pathlib import Path

import torch

from pipeline.ondisk.atomic import replace_dir, write_json, writing
from pipeline.train.config import TrainConfig
from pipeline.train.files import CHECKPOINTS
from pipeline.train.runtime import Runtime, barrier

LOSS = "kl_div"  # speculators 0.9's default loss for EAGLE-3: KL(target || draft) per TTT step


class MetricsFile(logging.Handler):
    """Appends speculators' per-step metric records to metrics.jsonl (rank 0 only)."""

    def __init__(self, path: Path):
        super().__init__(logging.INFO)
        self.path = path
        self.fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, dict):
            return
        row = {"step": getattr(record, "step", None), "time": round(record.created, 3), **record.msg}
        self.fh.write(json.dumps(row, default=float) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()
        super().close()


def loss_implementation(device: torch.device) -> str:
    """Always speculators' eager loss (the same values as its fused one). On CUDA speculators compiles the
    draft's whole forward, loss included (``conditional_torch_compile``), and dynamo then has to trace the
    fused loss's autotuned Triton kernels: on the H200 with torch 2.11 that failed in the first step
    ("ListVariable ... is already tracked for mutation", speculators/losses/fused.py;
    docs/benchmarks-history.md, learned target), while the eager loss is plain torch that the compiler fuses
    itself. On the CPU nothing is compiled and Triton does not run. Not yet re-measured on a GPU (the
    session's device time ran out): see docs/train.md."""
    del device
    return "eager"


def get_trainer_kwargs(model, cfg: TrainConfig, device: torch.device) -> tuple[dict, dict]:
    """The forward arguments of a training and a validation step (TTT unroll, loss), speculators' way."""
    return type(model).get_trainer_kwargs(
        ttt_steps=cfg.ttt_steps,
        ttt_step_loss_decay=cfg.ttt_step_loss_decay,
        loss_fn=LOSS,
        loss_implementation=loss_implementation(device),
    )


@contextlib.contextmanager
def _on_host(device: torch.device):
    """speculators 0.9's trainer on the CPU: its step timer synchronizes an accelerator unconditionally
    (there is none), and its autocast to fp32 warns on every step (CPU autocast has only 16-bit types)."""
    from speculators.train import trainer as trainer_mod

    if device.type != "cpu":
        yield
        return
    original = trainer_mod._StepTimer

    class HostStepTimer(original):
        def mark(self, name: str) -> None:
            if self.enabled:
                self._marks[name] = time.perf_counter()

        def now(self) -> float | None:
            return time.perf_counter() if self.enabled else None

    trainer_mod._StepTimer = HostStepTimer
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="In CPU autocast, but the target dtype is not supported"
            )
            yield
    finally:
        trainer_mod._StepTimer = original


def trainer_class():
    from speculators.train.checkpointer import (
        DistributedCheckpointer,
        SingleGPUCheckpointer,
        convert_float_dtype,
        load_safetensors_state_dict,
    )
    from speculators.train.trainer import Trainer
    from torch.nn.parallel import DistributedDataParallel

    class DeviceCheckpointer(SingleGPUCheckpointer):
        """speculators' checkpointer, loading onto the runtime's device (speculators assumes an
        accelerator)."""

        def __init__(self, path, device: torch.device):
            self.device = str(device)
            super().__init__(path)

        def load_model_state_dict(self, model, float_dtype=None):
            raw = model.module if isinstance(model, DistributedDataParallel) else model
            state = load_safetensors_state_dict(self.model_path(self.previous_epoch), self.device)
            raw.load_state_dict(convert_float_dtype(state, float_dtype or raw.dtype), strict=False)

        def load_optimizer_state_dict(self, model, optimizer, float_dtype=None):
            raw = model.module if isinstance(model, DistributedDataParallel) else model
            state = torch.load(
                self.optimizer_path(self.previous_epoch), weights_only=True, map_location=self.device
            )
            states = state if isinstance(state, list) else [state]
            for optim, st in zip(
                optimizer if isinstance(optimizer, list) else [optimizer], states, strict=True
            ):
                optim.load_state_dict(convert_float_dtype(st, float_dtype or raw.dtype))

    class PipelineTrainer(Trainer):
        """speculators' Trainer plus: any device, fp32 atomic checkpoints, stop-after, timing."""

        def __init__(
            self,
            *args,
            runtime: Runtime,
            stop_after: int | None,
            checkpoint_steps: int | None = None,
            **kwargs,
        ):
            self.runtime = runtime
            self.stop_after = stop_after
            self.checkpoint_steps = checkpoint_steps
            self.epoch_seconds: list[float] = []
            self.val_seconds: list[float] = []  # each epoch's validation (outside epoch_seconds)
            self.checkpoint_seconds: list[float] = []  # each epoch's checkpoint
            super().__init__(*args, **kwargs)

        def setup_trainer(self):
            # speculators moves batches to `local_rank` and autocasts on the accelerator type it finds
            self.local_rank = self.runtime.trainer_rank
            self.device_type = self.runtime.device.type
            if self.config.fsdp_shard:  # full state dicts gathered from the shards, saved by rank 0
                self.checkpointer = DistributedCheckpointer(self.config.save_path)
            else:
                self.checkpointer = DeviceCheckpointer(self.config.save_path, self.runtime.device)
            super().setup_trainer()
            self.steps_per_epoch = len(self.train_loader)  # before a resumed epoch's skip shortens it
            # a checkpoint taken inside an epoch resumes at its step (speculators skips the steps it holds)
            self.resume_step = self._resume_local_step
            self.global_step = self.current_epoch * self.steps_per_epoch + self.resume_step

        def _step_done(self, epoch: int) -> None:
            """After each training step: with --checkpoint-steps N, a checkpoint every N steps of the epoch
            (not after its last step: the epoch's own checkpoint follows its validation)."""
            local = self.global_step - epoch * self.steps_per_epoch
            if self.checkpoint_steps and local % self.checkpoint_steps == 0 and local < self.steps_per_epoch:
                self.save_checkpoint(epoch, local_step=local)

        def save_checkpoint(self, epoch: int, local_step: int = 0):
            final_root = self.checkpointer.path
            staging_root = final_root / ".staging"
            self.checkpointer.path = staging_root
            try:
                with writing(final_root / str(epoch)):  # a full disk told as such, naming the checkpoint
                    # full precision: a resumed run must continue from exactly the weights and moments it
                    # stopped at
                    self.checkpointer.save_checkpoint(
                        self.model, self.optimizers, epoch, float_dtype=torch.float32
                    )
                    if self.schedulers:
                        self.checkpointer.save_scheduler_state_dict(self.schedulers, epoch)
                if self.runtime.is_main:
                    # local_step 0: the epoch's end (resume continues with the next one); else the steps done
                    self._save_training_state(epoch, local_step)
            finally:
                self.checkpointer.path = final_root
            if self.runtime.is_main:
                replace_checkpoint(final_root, epoch)
            barrier(self.runtime)

        def _save_training_state(self, epoch: int, local_step: int) -> None:
            write_json(
                self.checkpointer.path / str(epoch) / "training_state.json",
                {"epoch": epoch, "local_step": local_step, "global_step": self.global_step},
            )

        def run_training(self):
            done = 0
            for epoch in range(self.current_epoch, self.config.num_epochs):
                if self.stop_after is not None and done >= self.stop_after:
                    break
                start = time.perf_counter()
                with _on_host(self.runtime.device):
                    self.train_epoch(epoch, step_callback=lambda e=epoch: self._step_done(e))
                if self.runtime.device.type == "cuda":
                    torch.cuda.synchronize()
                self.epoch_seconds.append(time.perf_counter() - start)
                barrier(self.runtime)
                start = time.perf_counter()
                with _on_host(self.runtime.device):
                    self.val_epoch(epoch)
                barrier(self.runtime)
                self.val_seconds.append(time.perf_counter() - start)
                start = time.perf_counter()
                self.save_checkpoint(epoch)
                self.checkpoint_seconds.append(time.perf_counter() - start)
                done += 1
            return done

    return PipelineTrainer


def replace_checkpoint(root: Path, epoch: int) -> None:
    """Move the save staged in ``root/.staging/EPOCH`` to ``root/EPOCH`` with renames only, so that a kill at
    any instant leaves either the old checkpoint or the new one whole (never a half-deleted directory):
    the old one is renamed aside first, the new one renamed in, then the old one deleted.
    `settle_checkpoints` finishes or undoes a replacement a kill cut short."""
    replace_dir(root / ".staging" / str(epoch), root / str(epoch), root / f".replaced-{epoch}")
    shutil.rmtree(root / ".staging", ignore_errors=True)


def settle_checkpoints(out: Path) -> None:
    """Undo what a killed save left in ``out``'s checkpoints (run before reading them, by one process): a
    half-written ``.staging`` save is deleted; a checkpoint renamed aside by `replace_checkpoint` is put
    back when its replacement never arrived, else deleted."""
    ckpt = Path(out) / CHECKPOINTS
    if not ckpt.is_dir():
        return
    shutil.rmtree(ckpt / ".staging", ignore_errors=True)
    for aside in ckpt.glob(".replaced-*"):
        final = ckpt / aside.name.removeprefix(".replaced-")
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)


def last_epoch(out: Path) -> int | None:
    ckpt = Path(out) / CHECKPOINTS
    epochs = [int(p.name) for p in ckpt.iterdir() if p.is_dir() and p.name.isdigit()] if ckpt.is_dir() else []
    return max(epochs) if epochs else None
