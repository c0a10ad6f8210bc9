"""Data parallel on one host: one ``extract-worker`` process per GPU group, each with its deal of the batch
plan and its own config on stdin; their progress merged into one bar, their figures into one."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from pipeline.ondisk import formats
from pipeline.errors import StageError
from pipeline.options import to_json
from pipeline.extract.config import ExtractConfig
from pipeline.extract.loop import FileRate, progress_bar, device_idle, process_age


def check_parallel(cfg: ExtractConfig) -> None:
    """What only this host can say of the options (the rest is checked at construction): enough GPUs."""
    import torch

    if cfg.data_parallel > 1 and cfg.local_rank is None and torch.cuda.is_available():
        per = gpus_per_worker(cfg, len(visible_devices()))
        if per < 1 or cfg.data_parallel * per > len(visible_devices()):
            raise StageError(
                f"--data-parallel {cfg.data_parallel} x {per} GPU(s) per worker but only "
                f"{len(visible_devices())} GPUs are visible: lower --data-parallel or --tensor-parallel-size"
            )


def gpus_per_worker(cfg: ExtractConfig, visible: int) -> int:
    """GPUs each data-parallel worker gets: one for hf; for vllm its tensor parallel size (default: the
    visible GPUs split evenly between the workers)."""
    if cfg.backend != "vllm":
        return 1
    return cfg.tensor_parallel_size or visible // cfg.data_parallel


def visible_devices() -> list[str]:
    import torch

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def worker_config(cfg: ExtractConfig, local_rank: int, tensor_parallel_size: int = 1) -> ExtractConfig:
    """One data-parallel worker's config: the launcher's own, told which slice of the plan is its
    (``local_rank``) and, for vllm, the tensor parallel size over its GPUs; the closing check and the bar
    stay with the launcher."""
    tp = tensor_parallel_size if cfg.backend == "vllm" else cfg.tensor_parallel_size
    return replace(cfg, local_rank=local_rank, tensor_parallel_size=tp, verify=False, progress=False)


WORKER_ARGV = [sys.executable, "-m", "pipeline", "extract-worker"]  # its config on stdin (worker_command)


def launch_workers(
    cfg: ExtractConfig, owned: set[int], done: set[int], lengths: Sequence[int], startup: dict
) -> dict:
    """Run one worker process per GPU (or per CPU slot), show their combined progress, fail if any fails.
    ``startup`` (this process's timeline) gains the moment the workers were started. The figures are a
    single process's: tok/s over the slowest worker's loop; the workers' start-up is in ``startup``."""
    import json
    import subprocess

    import torch

    devices = visible_devices() if torch.cuda.is_available() else []
    per = gpus_per_worker(cfg, len(devices)) if devices else 1
    procs = []
    t0 = time.perf_counter()
    for k in range(cfg.data_parallel):
        env = dict(os.environ)
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[k * per : (k + 1) * per])
        # each worker's OpenMP pool gets its share of the cores (host copies, CPU forward): N pools of
        # all cores oversubscribe the machine
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.data_parallel)))
        proc = subprocess.Popen(
            WORKER_ARGV, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        proc.stdin.write(to_json(worker_config(cfg, k, per)))
        proc.stdin.close()
    startup["workers_started_seconds"] = process_age()
    failed = []
    try:
        with progress_bar(cfg.progress) as bar:
            task = bar.add_task("extract", total=len(owned), completed=len(done), tps=0.0)
            rate = FileRate(owned, done, lengths)
            while any(p.poll() is None for p in procs):
                time.sleep(0.5)
                count, tps = rate.update(formats.existing_data_indices(cfg.out), time.perf_counter())
                bar.update(task, completed=count, tps=tps)
        outputs = [p.stdout.read() for p in procs]  # each ended; its stdin (the config) is closed already
        for p in procs:
            p.wait()
    except BaseException:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        raise
    for k, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        if p.returncode != 0:
            failed.append(f"worker {k} exited {p.returncode}")
    if failed:
        raise StageError(
            f"data-parallel extraction failed: {'; '.join(failed)} "
            "(re-run with --resume to redo what is missing)"
        )
    per = [json.loads(o.strip().splitlines()[-1]) for o in outputs]
    tokens = sum(w["tokens"] for w in per)
    loop = max(
        w["seconds"] for w in per
    )  # the workers' loops run side by side: the slowest one's is the run's
    stats = {
        "tokens": tokens,
        "seconds": loop,
        "tokens_per_s": tokens / loop if loop else 0.0,
        "wall_seconds": time.perf_counter() - t0,
        "bytes": sum(w["bytes"] for w in per),
        "workers": per,
        "startup": startup,
    }
    busy = [w["device_busy_seconds"] for w in per if "device_busy_seconds" in w]
    if len(busy) == len(
        per
    ):  # over the workers' loops: their start-up and model loads are not the loop's idle time
        stats.update(device_idle(sum(busy), sum(w["seconds"] for w in per)))
    return stats
