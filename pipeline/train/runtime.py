"""Where a ``pipeline train`` process trains: its device and its place in a torchrun job.

Owns ``Runtime`` (the device, the rank, the job's size) and its setup: one process on the CPU or a GPU; under
torchrun speculators' own setup on GPUs (NCCL, one GPU per rank) or, on the CPU, a gloo group with
speculators' topology state set as its setup would set it on an accelerator; the job's barrier; the trainer's
CUDA device made current again after a backend changed it. The training run itself is
pipeline/train/stage.py's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pipeline.errors import StageError


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    rank: int = 0
    world_size: int = 1
    distributed: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def trainer_rank(self):
        """What speculators' Trainer passes to ``.to()``: a GPU index, or "cpu"."""
        if self.device.type == "cuda":
            return self.device.index or 0
        return self.device.type


def setup_runtime(device: str) -> Runtime:
    """This process's device and rank. Under torchrun: speculators' own setup on GPUs (NCCL, one GPU per
    rank), a gloo group on the CPU (``--device cpu``, or auto with no GPU visible)."""
    if "LOCAL_RANK" in os.environ:  # torchrun
        from speculators.train import distributed as dist_state

        if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
            return setup_host_distributed()
        if not torch.cuda.is_available():
            raise StageError(
                f"torchrun data parallel with --device {device} needs GPUs (one per process) and none is "
                "visible: pass --device cpu (or auto) to train on the CPU, or run without torchrun"
            )
        dist_state.maybe_setup_distributed()
        return Runtime(
            torch.device("cuda", dist_state.get_local_rank()),
            dist_state.get_rank(),
            dist_state.get_world_size(),
            True,
        )
    if device == "auto":
        return Runtime(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise StageError("--device cuda but no CUDA device is visible: use --device cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
    return Runtime(dev)


def setup_host_distributed() -> Runtime:
    """torchrun on the CPU: a gloo process group, and speculators' topology state set as its
    ``maybe_setup_distributed`` sets it on an accelerator (which it requires), so that its Trainer wraps the
    draft in DistributedDataParallel (``is_distributed()``) and reduces its metrics over the group."""
    import torch.distributed as dist
    from speculators.train import distributed as dist_state

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dist_state._local_rank = int(os.environ["LOCAL_RANK"])
    dist_state._rank = rank
    dist_state._world_size = world_size
    dist_state._is_distributed = True  # maybe_destroy_distributed then tears the group down
    dist_state._init_sp_process_groups(rank, world_size, 1)  # sp 1: one data-parallel group of all ranks
    return Runtime(torch.device("cpu"), rank, world_size, True)


def barrier(rt: Runtime) -> None:
    if rt.distributed:
        torch.distributed.barrier()


def current_cuda_device(device: torch.device) -> torch.device | None:
    """The trainer's CUDA device with its index (``cuda`` alone is the current device: cuda:0 unless
    torchrun's rank chose another), to make current again after a backend changed it; None off CUDA."""
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
