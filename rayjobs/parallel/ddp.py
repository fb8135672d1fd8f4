"""Replicated data parallelism: DDP (one process per device) and nn.DataParallel (one process, all devices)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rayjobs import log
from rayjobs.context import WorkerContext


def wrap_ddp(model: nn.Module, ctx: WorkerContext, process_group: Any = None) -> nn.Module:
    """DDP over ``process_group`` (all ranks by default); the model itself on one rank or without a group."""
    if ctx.world_size == 1 or not dist.is_initialized():
        return model
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=process_group)


def wrap_data_parallel_module(model: nn.Module, ctx: WorkerContext) -> nn.Module:
    """``nn.DataParallel`` over this node's GPUs (the model itself with one device), with the advice to prefer DDP."""
    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    log.log(
        f"parallel.strategy=dataparallel: one process drives {max(gpus, 1)} device(s) through nn.DataParallel; "
        "prefer ddp (one process per GPU): it overlaps gradient all-reduce with backward and has no GIL bottleneck"
    )
    return nn.DataParallel(model) if gpus > 1 else model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper (DDP, DataParallel)."""
    return model.module if isinstance(model, (DistributedDataParallel, nn.DataParallel)) else model
