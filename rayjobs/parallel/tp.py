"""Tensor parallelism: DTensor column- and row-wise sharding of the modules a model's TP plan names."""

from __future__ import annotations

from typing import Any

from torch import nn

from rayjobs.parallel.layout import Layout, plan_matches


def apply_tensor_parallel(model: nn.Module, plan: dict[str, str], tp_mesh: Any, layout: Layout) -> None:
    """Shard the modules the plan names (``*`` matches one name) over ``tp_mesh``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    chosen = {}
    for fqn in layout.tp_sharded(model, plan):
        style = next(s for pattern, s in plan.items() if plan_matches(fqn, pattern))
        chosen[fqn] = styles[style]()
    parallelize_module(model, tp_mesh, chosen)
