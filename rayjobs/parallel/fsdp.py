"""Sharded data parallelism: FSDP2 ``fully_shard`` per block, then the root (also HSDP over a 2-D mesh)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rayjobs.context import WorkerContext


def apply_fsdp(
    model: nn.Module, dp_mesh: Any, blocks: Any, param_dtype: str, cpu_offload: bool, ctx: WorkerContext
) -> nn.Module:
    """Shard every block, then the root, over ``dp_mesh``; bf16 compute with fp32 reduction where asked.

    ``param_dtype``: ``bf16``, ``fp32``, or ``auto`` (bf16 on GPU, fp32 on CPU). Also on one rank:
    FSDP2's mixed-precision policy still applies.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    bf16 = param_dtype == "bf16" or (param_dtype == "auto" and ctx.device.type == "cuda")
    kwargs: dict[str, Any] = {
        "mesh": dp_mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy(),
    }
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in (blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks) if blocks is not None else []:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model
