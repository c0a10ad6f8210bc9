"""The ``train`` stage: hidden states + verifier weights + vocab mapping in, an EAGLE-3 draft checkpoint out.

Owns the training run on speculators 0.9.0, on inputs checked before the first step (the hidden states or a
produced run's plan, the target, the verifier, the vocab mapping, the train/held-out split:
pipeline/train/inputs.py): speculators' ``Trainer`` as pipeline/train/trainer.py subclasses it (any device,
full-precision atomic checkpoints, stop-after, timing), per-step metrics in ``metrics.jsonl``, the servable
export ``draft/`` and the final ``summary.json`` with the offline acceptance (pipeline/train/evaluate.py) and
the plots (pipeline/train/plots.py). The data loaders (our ``data_{i}.pt`` files through speculators' sampler
and collate) are pipeline/train/data.py; its options (``TrainConfig``) pipeline/train/config.py.

Output directory::

    train_config.json        resolved options, layer ids in both conventions, the split
    verifier/                the verifier view speculators loads embed_tokens / norm / lm_head from
    checkpoints/<epoch>/     per epoch: config.json, model.safetensors (fp32), optimizer + scheduler state
    draft/                   the final draft (config.json + model.safetensors in --save-dtype): serve this
    metrics.jsonl            one JSON line per training step (loss, per-TTT-step accuracy, lr) and per
                             validation
    eval.json                offline acceptance of the draft and of the baselines on held-out samples
    summary.json             train figures + eval.json
    loss.png, acceptance.png

The output follows pipeline/ondisk/outdir.py's policy: an --out that is, contains or lies inside an input (the
hidden states, the verifier, the target model, the prepared dir) is refused before anything is deleted, and
rank 0 holds the output's lock while the run writes it, so that a second train into it is refused.

Data parallel: started by ``torchrun --nproc-per-node N -m pipeline train ...`` each process trains on its
shard through speculators' DDP setup (one GPU per process; on the CPU, ``--device cpu`` or no GPU visible,
a gloo group: pipeline/train/runtime.py); rank 0 writes everything else. The draft architecture and its
config live in pipeline/train/draft.py.

``--states-mode online|hybrid``: no finished states set; ``--data`` is a states dir this run fills while it
trains, from ``--prepared`` through ``--model`` with an extract backend, its state files held to
``--states-budget`` (the plan, the producer thread and the waiting dataset: pipeline/train/states.py).
pipeline/train/inputs.py checks those inputs (``produced_inputs``); this module starts the producer at the
trainer's resume point, stops it at the end and reports its figures under ``train.states`` in the summary (the
glue: pipeline/train/produced.py). Under torchrun rank 0 alone owns the states dir (prepares it, runs the
producer over every rank's batches step by step, finishes it after every rank's epochs: barriers on both
sides) and the other ranks only read it; its hf producer is a thread, its vllm producer a process of its own
on the GPUs after the trainers' (pipeline/train/producer_process.py). ``--checkpoint-steps N`` adds
checkpoints inside an epoch, and a resumed run starts at the last one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from pipeline.ondisk import formats
from pipeline.ondisk.atomic import replace_dir, write_json
from pipeline.errors import StageError
from pipeline.ondisk.outdir import output_lock, refuse_overlap
from pipeline.train.inputs import TrainInputs, check_inputs, produced_inputs, resolve_prepared
from pipeline.train.trainer import (
    MetricsFile,
    get_trainer_kwargs,
    last_epoch,
    settle_checkpoints,
    trainer_class,
)
from pipeline.train.runtime import Runtime, barrier, current_cuda_device, setup_runtime
from pipeline.train.config import TrainConfig
from pipeline.train import produced as produced_mod
from pipeline.train.data import seed_everything
from pipeline.train.files import (
    CHECKPOINTS,
    DRAFT,
    EVAL,
    METRICS,
    SUMMARY,
    TRAIN_CONFIG,
    VERIFIER_VIEW,  # noqa: F401
    last_metrics,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLEX_BLOCK = 128
REPORT_GRACE_S = 30  # torchrun: how long other ranks leave rank 0 to report a failed producer


def states_dtype(device: torch.device) -> torch.dtype:
    """The dtype hidden states travel in, from the loader to the step, and the trainer's autocast dtype: one
    choice. bf16 on GPUs, as speculators' own loader and trainer do: the autocast casts every matmul input to
    bf16 either way, and bf16 batches halve the host's conversion, collation and pinning work and the bytes
    copied to the device against fp32 ones (docs/train.md). fp32 on the CPU, which trains in fp32 (its
    autocast has only 16-bit types)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def loader_workers(cfg: TrainConfig, rt: Runtime) -> int:
    """Each loader's worker processes: ``--num-workers``, else 4 on a GPU and none on the CPU."""
    return cfg.num_workers if cfg.num_workers is not None else (4 if rt.device.type == "cuda" else 0)


def make_loader(
    files: list[Path],
    cfg: TrainConfig,
    rt: Runtime,
    *,
    shuffle_seed: int,
    hidden_size: int,
    transient: frozenset[str] | None = None,
):
    """The loader of ``files``; with ``transient`` (online/hybrid) over files still being produced, those
    named deleted once read (pipeline/train/states.py)."""
    from pipeline.train.data import READER_START
    from pipeline.train.data import make_loader as loader

    workers = loader_workers(cfg, rt)
    dataset, start = None, None
    if transient is not None:
        from pipeline.train.datasets import ProducedDataset

        start = READER_START  # never fork the trainer while the producer's thread and CUDA context are live
        dataset = ProducedDataset(files, cfg.max_len, states_dtype(rt.device), transient, start)
    return loader(
        files,
        max_len=cfg.max_len,
        hidden_size=hidden_size,
        world_size=rt.world_size,
        rank=rt.rank,
        seed=shuffle_seed,
        workers=workers,
        pin_memory=rt.device.type == "cuda",
        dtype=states_dtype(rt.device),
        dataset=dataset,
        start=start,
    )


def _stop_loader_workers(*loaders) -> None:
    """End the loaders' persistent worker processes now, the run's epochs done or failed. torch ends them
    when a loader's iterator is collected; a failed run's traceback keeps the iterator, and at exit
    multiprocessing then terminates the workers under torch's SIGCHLD watch, which raises in the main thread
    after the run's one-line error ("DataLoader worker ... is killed by signal: Terminated")."""
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)  # None before the first epoch
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def _check_out(cfg: TrainConfig) -> None:
    """The refusals of --out as the run finds it: every rank checks before rank 0 writes there."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise StageError(f"output {out} exists and is not a directory: choose another --out")
    if cfg.resume and cfg.overwrite:
        raise StageError(
            "--resume and --overwrite exclude each other: "
            "resume keeps the checkpoints, overwrite deletes them"
        )
    if out.is_dir() and any(out.iterdir()) and not (cfg.resume or cfg.overwrite):
        raise StageError(
            f"output dir {out} is not empty: pass --resume to continue its checkpoints, "
            "--overwrite to replace it, or choose another --out"
        )


def _prepare_out(cfg: TrainConfig, rt: Runtime) -> None:
    out = Path(cfg.out)
    ckpt = out / CHECKPOINTS
    if rt.is_main and cfg.resume:
        settle_checkpoints(out)  # only a dir we were asked to continue
    has_epochs = ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())
    if cfg.resume and not has_epochs and rt.is_main:
        logging.getLogger("pipeline.train").warning(
            "--resume: no checkpoint in %s, starting from scratch", ckpt
        )
    if rt.is_main:
        if cfg.overwrite and out.is_dir():
            for name in (
                CHECKPOINTS,
                DRAFT,
                VERIFIER_VIEW,
                METRICS,
                EVAL,
                SUMMARY,
                TRAIN_CONFIG,
                "loss.png",
                "acceptance.png",
            ):
                p = out / name
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)


def export_draft(checkpoint: Path, target: Path, dtype: torch.dtype, verifier_name_or_path: str) -> Path:
    """Copy an epoch checkpoint's config and weights (cast to ``dtype``) into a servable dir, atomically.

    The exported config names the real target model as the verifier (what ``vllm serve DRAFT`` would
    load as the target), not the training-time verifier view; ``load_draft`` finds the view beside it.
    """
    from safetensors.torch import load_file, save_file

    staging = target.with_name(f".{target.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    state = load_file(str(checkpoint / "model.safetensors"))
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((checkpoint / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config["torch_dtype"] = config["dtype"]
    config["speculators_config"]["verifier"]["name_or_path"] = verifier_name_or_path
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    replace_dir(staging, target, target.with_name(f".{target.name}.old-{os.getpid()}"))
    return target


def _config_record(cfg: TrainConfig, inputs: TrainInputs, rt: Runtime, attention: str) -> dict:
    rec = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    rec.update(
        layer_ids=inputs.layer_ids,
        eagle_aux_hidden_state_layer_ids=inputs.vllm_aux_layer_ids,
        layer_id_convention=(
            "layer_ids: OUTPUT of decoder layer k (extract); "
            "eagle_aux_hidden_state_layer_ids: INPUT of layer k+1 (vLLM)"
        ),
        draft_vocab_size=len(inputs.d2t),
        target_vocab_size=inputs.target.vocab_size,
        hidden_size=inputs.target.hidden_size,
        train_files=[p.name for p in inputs.train_files],
        eval_files=[p.name for p in inputs.eval_files],
        world_size=rt.world_size,
        device=str(rt.device),
        attention=attention,
    )
    return rec


RESUME_KEYS = (
    "layer_ids",
    "draft_vocab_size",
    "target_vocab_size",
    "hidden_size",
    "num_layers",
    "ttt_steps",
    "train_files",
    "eval_files",
    "seed",
    "max_len",
    "intermediate_size",
    "norm_before_residual",
)


def _check_resumable(previous: dict, now: dict, out: Path) -> None:
    """A resumed run must continue the same model on the same split; epochs and lr may change."""
    changed = [k for k in RESUME_KEYS if previous.get(k) != now.get(k)]
    if changed:
        raise StageError(
            f"--resume: {', '.join(changed)} differ from the run in {out} (train_config.json): "
            "resume with the same inputs and options, or start over with --overwrite"
        )


class PhaseClock:
    """Wall seconds of a run's phases, each from the end of the one before: where a run's time goes beyond
    its epochs (the summary's ``phase_seconds``: setup, training, of which training_validation and
    training_checkpoints, states_finish, export, evaluation)."""

    def __init__(self):
        self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._last, 3)
        self._last = now

    def line(self) -> str:
        return ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())


def run(cfg: TrainConfig, log=print) -> dict:
    """Train, export, evaluate; return the summary (rank 0) or {} (other ranks)."""
    from pipeline.train import draft as draft_mod

    clock = PhaseClock()
    rt = setup_runtime(cfg.device)
    if cfg.fsdp and not rt.distributed:
        raise StageError(
            "--fsdp shards the draft over torchrun's processes and this is one process: start it with "
            "torchrun --nproc-per-node N, or drop --fsdp"
        )
    if rt.device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: the draft trains in fp32 parameters
    held = contextlib.ExitStack()  # the output's lock, held by rank 0 until the run ends
    producer = None
    fresh = not Path(cfg.out).exists()  # this run creates --out: a failure before any epoch takes it away
    try:
        produced = None
        if cfg.states_mode == "offline":
            inputs = check_inputs(cfg)
        else:
            inputs, produced = produced_inputs(cfg, rt.world_size)
            if loader_workers(cfg, rt):
                from pipeline.train.data import start_reader_server

                start_reader_server()  # the workers' imports, done beside this setup (make_loader)
        attention = draft_mod.choose_attention(rt.device, cfg.attention)
        if attention == draft_mod.FLEX_ATTENTION and cfg.max_len % FLEX_BLOCK:
            raise StageError(
                f"--max-len {cfg.max_len} must be a multiple of {FLEX_BLOCK} with flex attention "
                "(speculators' block mask)"
            )
        if len(inputs.eval_files) < rt.world_size:
            raise StageError(
                f"{len(inputs.eval_files)} held-out samples for {rt.world_size} processes: "
                "raise --eval-fraction"
            )
        refuse_overlap(
            Path(cfg.out),
            {
                "--data": cfg.data,
                "--verifier": cfg.verifier,
                "--model": inputs.model_dir,
                "--prepared": resolve_prepared(cfg, inputs.data_config),
            },
        )
        if produced is not None:  # the states dir is written and emptied: it must not hold an input either
            refuse_overlap(
                Path(cfg.data),
                {
                    "--out": cfg.out,
                    "--verifier": cfg.verifier,
                    "--model": cfg.model,
                    "--prepared": cfg.prepared,
                },
            )
        _check_out(cfg)
        barrier(rt)  # every rank has seen --out as it was before rank 0 writes there
        if rt.is_main:  # for the whole torchrun job: the other ranks are its processes, not other writers
            held.enter_context(output_lock(cfg.out))
            if produced is not None:
                held.enter_context(output_lock(cfg.data))
        _prepare_out(cfg, rt)
        out = Path(cfg.out)
        view = out / VERIFIER_VIEW
        record = _config_record(cfg, inputs, rt, attention)
        if cfg.resume and (out / TRAIN_CONFIG).is_file():
            _check_resumable(json.loads((out / TRAIN_CONFIG).read_text()), record, out)
        if rt.is_main:
            draft_mod.write_verifier_view(view, inputs.verifier, inputs.target)
            write_json(out / TRAIN_CONFIG, record)
        barrier(rt)
        backend = None
        if produced is not None and rt.is_main:  # rank 0 owns the states dir and its producer
            from pipeline.train import states

            present = states.prepare_states_dir(
                Path(cfg.data),
                produced.data_config,
                produced.plan,
                produced.prepared,
                resume=cfg.resume,
                overwrite=cfg.overwrite,
                log=log,
            )
            # from here to the run's end rank 0 vouches for the states dir: a rank whose wait outlives a
            # rank 0 killed with torchrun's agent ends instead of waiting forever (states.Heartbeat)
            held.enter_context(states.Heartbeat(Path(cfg.data)))
            # loaded before the seed: a model load may draw from torch's generator, the draft's init must not
            # see it
            log(
                f"states: the {produced.backend} backend produces ({produced.backend_reason}"
                f"{produced.share_reason})"
            )
            trainer_device = current_cuda_device(rt.device)
            if produced.engine is not None:  # a vllm engine in a process of its own (engine_placement)
                from pipeline.train.producer_process import ProducerProcess, engine_environment

                env = engine_environment(os.environ, produced.engine.gpus)
                backend = held.enter_context(ProducerProcess(produced.backend, produced.backend_options, env))
            else:
                from pipeline.train.reaper import open_backend

                backend = open_backend(held, produced.backend, produced.backend_options)
            got = str(backend.dtype).removeprefix("torch.")
            if got != produced.data_config.dtype:  # the plan's sizes and the data config assume it
                raise StageError(
                    f"the {produced.backend} backend computes states in {got}, the plan assumed "
                    f"{produced.data_config.dtype}: pass --states-dtype {got}"
                )
            if trainer_device is not None:  # the hf backend made its own device the current one
                torch.cuda.set_device(trainer_device)
        if produced is not None:  # the other ranks read the states dir once rank 0 has prepared it
            barrier(rt)

        seed_everything(cfg.seed)
        spec_config = draft_mod.build_speculator_config(
            target=inputs.target,
            verifier_view=view,
            draft_vocab_size=len(inputs.d2t),
            vllm_aux_layer_ids=inputs.vllm_aux_layer_ids,
            ttt_steps=cfg.ttt_steps,
            num_layers=cfg.num_layers,
            norm_before_residual=cfg.norm_before_residual,
            intermediate_size=cfg.intermediate_size,
        )
        draft_mod.set_attention(spec_config, attention)
        model = draft_mod.new_draft(spec_config, inputs.d2t, inputs.t2d)

        hidden = inputs.target.hidden_size
        transient = None
        if produced is not None:
            transient = frozenset(
                formats.data_file(Path(cfg.data), i).name
                for i in range(len(produced.prepared))
                if i not in produced.plan.keep
            )
        train_loader = make_loader(
            inputs.train_files, cfg, rt, shuffle_seed=cfg.seed, hidden_size=hidden, transient=transient
        )
        val_loader = make_loader(
            inputs.eval_files,
            cfg,
            rt,
            shuffle_seed=cfg.seed,
            hidden_size=hidden,
            transient=frozenset() if produced is not None else None,
        )
        if len(train_loader) == 0:
            raise StageError(
                f"no training batch could be formed from {len(inputs.train_files)} samples "
                f"on {rt.world_size} processes"
            )
        from speculators.train.trainer import TrainerConfig

        call, val_call = get_trainer_kwargs(model, cfg, rt.device)
        tconfig = TrainerConfig(
            lr=cfg.lr,
            num_epochs=cfg.epochs,
            save_path=str(out / CHECKPOINTS),
            resume_from_checkpoint=cfg.resume,
            train_call_kwargs=call,
            val_call_kwargs=val_call,
            scheduler_type=cfg.scheduler,
            scheduler_warmup_steps=cfg.warmup_steps,
            hidden_states_dtype=states_dtype(rt.device),  # the autocast dtype, the loader's too
            fsdp_shard=cfg.fsdp,
        )
        trainer = trainer_class()(
            model,
            tconfig,
            train_loader,
            val_loader,
            runtime=rt,
            stop_after=cfg.stop_after_epochs,
            checkpoint_steps=cfg.checkpoint_steps,
        )
        start_epoch = trainer.current_epoch
        if rt.is_main and cfg.resume:
            # steps after the checkpoint are trained again: their rows of the killed run go
            trim_metrics(out / METRICS, trainer.global_step, start_epoch)
        metric_logger = logging.getLogger("speculators.metrics")
        metric_logger.setLevel(logging.INFO)
        handler = MetricsFile(out / METRICS) if rt.is_main else None
        if handler:
            metric_logger.addHandler(handler)
        try:
            log(
                f"training epochs {start_epoch}..{cfg.epochs - 1} on {rt.device} x{rt.world_size}: "
                f"{len(inputs.train_files)} train / {len(inputs.eval_files)} held-out samples, "
                f"{len(train_loader)} steps per epoch"
                + (f"; resuming at step {trainer.global_step}" if cfg.resume else "")
            )
            if produced is not None and rt.is_main:
                producer = produced_mod.start(
                    cfg, produced, backend, train_loader, trainer, present, rt.world_size, log
                )
            clock.lap("setup")  # inputs checked, the backend loaded, the draft built, the loaders made
            try:
                epochs_run = trainer.run_training()
            except Exception:
                from pipeline.train.states import rank0_gone, reported_failure

                failure = reported_failure(cfg.data) if produced is not None else None
                if failure is not None:  # a loader worker's report of it is many lines (a peer's gloo error)
                    if not rt.is_main and not rank0_gone(cfg.data):  # no rank 0 left to report it
                        _leave_the_report_to_rank0(train_loader, val_loader)
                    raise failure from None
                raise
        finally:
            _stop_loader_workers(train_loader, val_loader)
            if handler:
                metric_logger.removeHandler(handler)
                handler.close()
        clock.lap("training")  # the epochs, their validations and checkpoints
        clock.seconds["training_validation"] = round(sum(trainer.val_seconds), 3)
        clock.seconds["training_checkpoints"] = round(sum(trainer.checkpoint_seconds), 3)
        states_stats = None
        if produced is not None:  # every rank's epochs done: no reader of the states dir is left
            barrier(rt)
        if producer is not None:
            states_stats = produced_mod.finish(cfg, produced, producer, train_loader)
            producer = None
            backend.close()  # its memory (a vLLM engine's GPUs) is free for the evaluation; closes once
            clock.lap("states_finish")
        final = last_epoch(out)
        complete = final is not None and final == cfg.epochs - 1
        tokens = inputs.train_tokens * epochs_run
        seconds = sum(trainer.epoch_seconds)
        train_stats = {
            "epochs_run_now": epochs_run,
            "last_epoch": final,
            "complete": complete,
            "world_size": rt.world_size,
            "data_parallel": _parallel_kind(trainer.model),
            "device": str(rt.device),
            "train_tokens_per_epoch": inputs.train_tokens,
            "train_seconds": round(seconds, 3),
            "epoch_seconds": [round(e, 3) for e in trainer.epoch_seconds],  # the first holds compile warm-up
            "train_tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "steps_per_epoch": trainer.steps_per_epoch,
            "phase_seconds": clock.seconds,  # the same dict: later phases land in it before the summary
        }
        if states_stats is not None:
            train_stats["states"] = states_stats
        if not rt.is_main:
            return {}
        if not complete:
            log(f"stopped after epoch {final}; continue with --resume")
            summary = {"stage": "train", "out": str(out), "train": train_stats, "complete": False}
            write_json(out / SUMMARY, summary)
            return summary
        export_draft(
            out / CHECKPOINTS / str(final), out / DRAFT, DTYPES[cfg.save_dtype], str(inputs.model_dir)
        )
        clock.lap("export")
        log(f"draft checkpoint: {out / DRAFT}")
        summary = {
            "stage": "train",
            "out": str(out),
            "draft": str(out / DRAFT),
            "complete": True,
            "layer_ids": inputs.layer_ids,
            "eagle_aux_hidden_state_layer_ids": inputs.vllm_aux_layer_ids,
            "draft_vocab_size": len(inputs.d2t),
            "ttt_steps": cfg.ttt_steps,
            "epochs": cfg.epochs,
            "train": train_stats,
            "train_metrics": last_metrics(out / METRICS),
        }
        if cfg.evaluate:
            from pipeline.train.evaluate import EvalConfig, evaluate_run

            ev = evaluate_run(
                EvalConfig(
                    out=out,
                    k=cfg.eval_k or cfg.ttt_steps,
                    max_samples=cfg.eval_max_samples,
                    seed=cfg.seed,
                    device=str(rt.device),
                    attention=attention,
                ),
                inputs,
            )
            if cfg.online_eval:
                ev["online"] = _online(cfg, inputs, out)
            write_json(out / EVAL, ev)
            summary["eval"] = ev
            clock.lap("evaluation")
        log(f"phases: {clock.line()}")
        write_json(out / SUMMARY, summary)
        if cfg.plots:
            from pipeline.train import plots

            plots.draw_all(out)
        return summary
    except BaseException:
        # a run that created --out and fails (a full disk, Ctrl-C, a bad input found late) before its first
        # epoch's checkpoint leaves nothing to resume: no half-written output either (one process only: in a
        # torchrun job the other ranks may still write there)
        if (
            fresh
            and rt.is_main
            and rt.world_size == 1
            and Path(cfg.out).is_dir()
            and last_epoch(cfg.out) is None
        ):
            shutil.rmtree(cfg.out, ignore_errors=True)
        raise
    finally:
        try:
            if producer is not None:  # the trainer failed: stop producing before the backend is closed
                producer.stop()
        finally:  # the backend (a vLLM engine and its processes) is closed even if that wait is interrupted
            held.close()
        if rt.distributed:
            from speculators.train.distributed import maybe_destroy_distributed

            maybe_destroy_distributed()


def trim_metrics(path: Path, global_step: int, epoch: int) -> int:
    """Resume: drop metrics.jsonl's training rows of steps >= ``global_step`` and validation rows of epochs
    >= ``epoch`` (a killed run logged them after its last checkpoint; they are run again), atomically;
    return the rows dropped."""
    from pipeline.train.files import read_metrics

    rows = read_metrics(path)
    keep = [
        r
        for r in rows
        if not ("train" in r and (r.get("step") or 0) >= global_step)
        and not ("val" in r and r.get("epoch", -1) >= epoch)
    ]
    if len(keep) != len(rows):
        from pipeline.ondisk.atomic import atomic_path

        with atomic_path(path) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    return len(rows) - len(keep)


def _parallel_kind(model) -> str | None:
    """How the trainer holds the draft across torchrun's processes: "fsdp" (sharded), "ddp" (a full copy
    each), None (one process)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, FSDPModule):
        return "fsdp"
    return "ddp" if isinstance(model, DistributedDataParallel) else None


def _leave_the_report_to_rank0(*loaders) -> None:
    """A rank other than 0 whose reader saw the producer fail: the job's error is rank 0's one line, and
    torchrun ends the other ranks as soon as one rank ends. So this rank leaves the process group (a rank 0
    waiting for it in a collective is let go at once), ends its loader workers and waits up to
    REPORT_GRACE_S for rank 0 to end the job; only then does it report the failure itself."""
    from speculators.train.distributed import maybe_destroy_distributed

    maybe_destroy_distributed()
    _stop_loader_workers(*loaders)
    time.sleep(REPORT_GRACE_S)


def online_dtype(cfg: TrainConfig, model_dir: Path) -> str:
    """vLLM's dtype for serving the draft: the model's own ("auto") for a draft saved in bf16; float32 for
    one saved in fp32 (greedy equality exact on the CPU), except for an MLA target on a GPU, whose attention
    vLLM runs in bf16 or fp16 only (``fp32_mla_on_gpu``): bfloat16 there."""
    from pipeline.backends.base import visible_device_count
    from pipeline.backends.vllm import fp32_mla_on_gpu
    from pipeline.model.modeldir import read_model_dir

    if cfg.save_dtype != "float32":
        return "auto"
    raw = read_model_dir(model_dir).raw
    return (
        "bfloat16" if fp32_mla_on_gpu(raw, "float32", visible_device_count() > 0, os.environ) else "float32"
    )


def _online(cfg: TrainConfig, inputs: TrainInputs, out: Path) -> dict:
    """vLLM's own acceptance of the exported draft on the held-out prompts (pipeline/train/online_eval.py)."""
    from pipeline.train import online_eval

    k = cfg.eval_k or cfg.ttt_steps
    ocfg = online_eval.OnlineConfig(
        target=inputs.model_dir,
        draft=out / DRAFT,
        k=k,
        max_tokens=cfg.online_max_tokens,
        max_model_len=max(cfg.max_len, inputs.data_config.seq_length) + cfg.online_max_tokens,
        dtype=online_dtype(cfg, inputs.model_dir),
    )
    return online_eval.measure(
        ocfg, online_eval.prompts_of(inputs.eval_files, cfg.online_prompts), out / "online"
    )
