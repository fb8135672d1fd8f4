"""Parallelism applied from outside the model: strategies as data, the Layout, one file per family.

    layout.py   Strategy table, Layout (degrees, mesh coordinates, stage bounds, what TP shards)
    ddp.py      DDP and nn.DataParallel
    fsdp.py     FSDP2 (fsdp, hsdp, and the data-parallel half of fsdp+tp)
    tp.py       tensor parallelism from a model's TP plan
    pp.py       pipeline stages and schedules
    apply.py    the order (stage, TP, activation checkpointing, compile, data parallel) and the checks

A new strategy is a row in ``layout.STRATEGIES`` (and, if it wraps differently, a file here),
plus its name in ``rayjobs.config.STRATEGIES``.
"""

from rayjobs.parallel.apply import (
    Parallelized,
    apply,
    blocks_of,
    build_mesh,
    clip_grad_norm,
    layout_problems,
    meta_model,
    place,
)
from rayjobs.parallel.ddp import unwrap, wrap_ddp
from rayjobs.parallel.layout import (
    DEGREES,
    STRATEGIES,
    Layout,
    Strategy,
    elastic_strategies,
    microbatches,
    resolve_layout,
    strategy,
)
from rayjobs.parallel.pp import Pipeline

__all__ = [
    "DEGREES",
    "STRATEGIES",
    "Layout",
    "Parallelized",
    "Pipeline",
    "Strategy",
    "apply",
    "blocks_of",
    "build_mesh",
    "clip_grad_norm",
    "elastic_strategies",
    "layout_problems",
    "meta_model",
    "microbatches",
    "place",
    "resolve_layout",
    "strategy",
    "unwrap",
    "wrap_ddp",
]
