"""The worker's place in the job: its rank, world size, device and data shard; small collectives.

Models in ``models/`` know nothing of this module. A leaf: imports nothing of rayjobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class WorkerContext:
    """Where this process sits in the job: its rank, the world size, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # Set by rayjobs.parallel.place: ranks that share a model replica (tensor or pipeline
    # parallel) share a data shard, and one rank per replica counts its loss and accuracy.
    dp_rank: int | None = None
    dp_size: int | None = None
    counts_metrics: bool = True

    @property
    def is_main(self) -> bool:
        """True on the rank that prints, saves and reports what is shared."""
        return self.rank == 0

    @property
    def data_shard(self) -> tuple[int, int]:
        """(this rank's data shard, number of shards): its data-parallel rank and degree."""
        if self.dp_size is None:
            return self.rank, self.world_size
        return int(self.dp_rank or 0), self.dp_size

    @classmethod
    def from_process_group(cls, device: torch.device | None = None) -> WorkerContext:
        """Read rank and world size from ``torch.distributed`` (one process when not initialized)."""
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = 0, 1
        local_rank = device.index if device is not None and device.index is not None else 0
        return cls(rank, world, local_rank, device or torch.device("cpu"))


def current_context(use_gpu: bool) -> WorkerContext:
    """The context of a Ray Train worker (also local mode), or of a plain process."""
    try:
        import ray.train
        import ray.train.torch

        ray_ctx = ray.train.get_context()
        device = ray.train.torch.get_device() if use_gpu else torch.device("cpu")
        return WorkerContext(ray_ctx.get_world_rank(), ray_ctx.get_world_size(), ray_ctx.get_local_rank(), device)
    except (ImportError, RuntimeError):
        return WorkerContext.from_process_group(torch.device("cuda") if use_gpu else None)


def all_reduce_sum(values: list[float], ctx: WorkerContext) -> list[float]:
    """Sum a few floats over all ranks (float64 on the worker's device)."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    if ctx.world_size > 1 and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()
