"""The ``extract`` stage: prepared samples in, one ``data_{i}.pt`` of captured hidden states per sample out.

``run`` puts the package together: the config and the model folder checked, the batch plan (plan.py), the
output directory's policy (resume.py), then the loop (loop.py) in this process or in data-parallel workers
(workers.py); the directory's bookkeeping (data_config.json, sample_lengths.json, summary.json) at the end.
How states are computed is the backend's business (pipeline/backends/)."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, replace

from contract.experts import experts_met
from pipeline.ondisk import formats, provenance
from pipeline.backends import BACKENDS, BackendOptions, get_backend
from pipeline.backends.base import visible_device_count
from pipeline.errors import StageError
from pipeline.model.layers import validate_layer_ids
from pipeline.model.experts import expert_parallel_refusal
from pipeline.model import quantization
from pipeline.model.modeldir import check_checkpoint, read_model_dir
from pipeline.extract.config import AUTO_ON_OFF, ExtractConfig
from pipeline.extract.plan import deal, plan_shard
from pipeline.extract.resume import (
    pending_batches,
    prepare_output_dir,
    record_missing_checksums,
)
from pipeline.extract.loop import compute_path, process_age, run_loop
from pipeline.extract.workers import check_parallel, launch_workers


def run(cfg: ExtractConfig) -> dict:
    import torch

    # where a run's time goes before its loop (interpreter and imports, model load): reported in the stats
    startup = {"imports_seconds": process_age()}
    if cfg.backend == "auto":
        from pipeline.backends.choice import resolve

        choice = resolve(cfg.backend, cfg.model)
        # said on stdout beside the closing line (stderr carries only a failure's one `error:` line)
        startup["backend_choice"] = f"backend {choice.backend}: {choice.reason}"
        cfg = replace(cfg, backend=choice.backend)
    check_parallel(cfg)
    prepared, meta = formats.read_prepared(cfg.prepared)
    model = read_model_dir(cfg.model)
    check_checkpoint(model)  # every layer the config claims has weights, none is left unused
    if meta.target_vocab_size != model.vocab_size:
        raise StageError(
            f"{cfg.prepared} was prepared for a vocab of {meta.target_vocab_size}, "
            f"but {cfg.model} has {model.vocab_size}: re-run prepare with this model"
        )
    layer_ids = validate_layer_ids(cfg.layer_ids, model.num_layers)
    if cfg.expert_parallel and (
        refusal := expert_parallel_refusal(cfg.backend, model.path, model.raw, visible_device_count() > 0)
    ):
        raise StageError(refusal)
    if cfg.backend not in BACKENDS:
        raise StageError(f"unknown --backend {cfg.backend!r}: choose one of {', '.join(BACKENDS)}")
    if refusal := quantization.refusal(cfg.backend, model.raw, experts_met(model.raw)[1]):
        raise StageError(refusal)
    n = len(prepared) if cfg.limit is None else min(cfg.limit, len(prepared))
    if n <= 0:
        raise StageError(f"--limit {cfg.limit} selects no samples")
    lengths = prepared.lengths()[:n]
    options = BackendOptions(
        model=model,
        layer_ids=tuple(layer_ids),
        device=cfg.device,
        dtype=cfg.dtype,
        seq_length=meta.seq_length,
        tensor_parallel_size=cfg.tensor_parallel_size,
        max_batch_tokens=cfg.max_batch_tokens,
        trust_remote_code=cfg.trust_remote_code,
        enforce_eager=cfg.enforce_eager,
        expert_parallel=cfg.expert_parallel,
        scratch_dir=cfg.out,
        compile=AUTO_ON_OFF[cfg.compile],
        fused_experts=AUTO_ON_OFF[cfg.fused_experts],
    )
    from pipeline.backends.base import resolve_device, resolve_dtype

    dtype = (
        resolve_dtype(cfg.dtype, resolve_device(cfg.device))
        if cfg.backend == "hf"
        else resolve_dtype("bfloat16" if cfg.dtype == "auto" else cfg.dtype, torch.device("cpu"))
    )
    # the plan (pure): this host's shard, and a worker's deal of it
    plan = plan_shard(lengths, cfg.world_size, cfg.rank, cfg.max_batch_tokens, cfg.max_batch_size)
    owned = {i for b in plan for i in b.indices}
    if cfg.local_rank is not None:
        # deal the whole plan, not the pending part: workers list the directory at different moments
        plan = deal(plan, cfg.data_parallel, cfg.local_rank)
    # the output directory: resume, overwrite or refuse; what is done already; the batches left
    expected = formats.states_config(
        model, layer_ids, dtype, n, meta.seq_length, cfg.prepared, cfg.backend, provenance.record("extract")
    )
    if cfg.local_rank is None:
        done = prepare_output_dir(cfg, expected, prepared, owned)
    else:  # a worker: the launcher applied the output policy; it only re-reads what exists
        done = set(formats.existing_data_indices(cfg.out))
    done &= owned
    if cfg.local_rank is None:
        record_missing_checksums(cfg.out, done)
    batches = pending_batches(plan, done)
    stats = {"tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0, "bytes": 0}
    if batches and cfg.data_parallel > 1 and cfg.local_rank is None:
        stats = launch_workers(cfg, owned, done, lengths, startup)
    elif batches:
        if "OMP_NUM_THREADS" not in os.environ and visible_device_count() > 0:
            # the host side of a GPU run is copies; an OpenMP pool of every core slowed the hf backend 2x on
            # a 32-core H200 host (docs/benchmarks-history.md), half the cores (at most 16) did not. The vllm
            # backend's host side is the same kind of work (each writer thread writes a sample's states),
            # so it gets the same cap; at tensor parallel 1 its engine runs in this process, on the GPU
            torch.set_num_threads(max(1, min(16, (os.cpu_count() or 2) // 2)))
        load0 = time.perf_counter()
        options = replace(options, planned_tokens=sum(int(lengths[i]) for b in batches for i in b.indices))
        with get_backend(cfg.backend, options) as backend:
            startup.update(model_load_seconds=time.perf_counter() - load0, loop_start_seconds=process_age())
            startup.update(backend.startup)  # the load's parts, where the backend measures them
            # how the states were computed, so that `verify --model` recomputes them the same way (bf16 paths
            # that round differently drift apart at deep layers: 10-11% on random 8B weights, H200)
            expected.extra["compute_path"] = compute_path(backend)
            stats = run_loop(
                backend,
                prepared,
                batches,
                cfg.out,
                model.hidden_size,
                len(layer_ids),
                len(owned),
                done,
                cfg.progress,
                cfg.writer_threads,
            )
    if cfg.local_rank is None:
        formats.write_sample_lengths(cfg.out, {i: int(lengths[i]) for i in range(n)})
        formats.fold_checksums(cfg.out, owned, cfg.world_size, cfg.rank)
        expected.provenance = provenance.record("extract")  # its finished time: now
        formats.write_data_config(cfg.out, expected)
    stats.update(
        samples=n, owned=len(owned), batches_run=len(batches), resumed_from=len(done), config=asdict(expected)
    )
    stats.setdefault("startup", startup)
    return stats
