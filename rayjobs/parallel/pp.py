"""Pipeline parallelism: a stage is the model minus the other stages' parts; a schedule runs the micro-batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from models import ParallelPlan
from rayjobs.context import WorkerContext
from rayjobs.parallel.layout import Layout


@dataclass
class Pipeline:
    """This rank's pipeline stage and its schedule."""

    schedule: Any
    stage_index: int
    num_stages: int
    microbatches: int
    group: Any

    @property
    def is_first(self) -> bool:
        """Whether this stage takes the tokens."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage produces the logits and the loss."""
        return self.stage_index == self.num_stages - 1


def pipeline_stage(model: nn.Module, blocks: Any, plan: ParallelPlan, stage: int, layout: Layout) -> nn.Module:
    """The model minus the other stages' parts: an even share of the blocks, the plan's first parts on
    the first stage, its last parts on the last. Parameter names are unchanged, so DCP checkpoints match."""
    names = list(blocks.keys())
    bounds = layout.stage_bounds(len(names))
    keep = set(names[bounds[stage] : bounds[stage + 1]])
    for name in names:
        if name not in keep:
            del blocks[name]
    for attr in plan.pipeline_first if stage > 0 else ():
        setattr(model, attr, None)
    for attr in plan.pipeline_last if stage < layout.pp - 1 else ():
        setattr(model, attr, None)
    return model


def build_schedule(
    model: nn.Module,
    stage: int,
    layout: Layout,
    microbatches: int,
    kind: str,
    group: Any,
    ctx: WorkerContext,
    loss_fn: Any,
) -> Pipeline:
    """This stage's ``PipelineStage`` under a GPipe or 1F1B schedule of ``microbatches``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pstage = PipelineStage(model, stage, layout.pp, ctx.device, group=group)
    cls = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
    return Pipeline(cls(pstage, n_microbatches=microbatches, loss_fn=loss_fn), stage, layout.pp, microbatches, group)


def forward_backward(micro_batches: Sequence[tuple[Tensor, Tensor]], pipeline: Pipeline, ctx: WorkerContext) -> float:
    """One schedule step (forward and backward of every pipeline micro-batch); the last stage's mean loss."""
    x = torch.cat([b[0] for b in micro_batches]).to(ctx.device)
    y = torch.cat([b[1] for b in micro_batches]).to(ctx.device)
    losses: list[Tensor] = []
    args = (x,) if pipeline.is_first else ()
    if pipeline.is_last:
        pipeline.schedule.step(*args, target=y, losses=losses)
        return float(torch.stack([loss.detach().double() for loss in losses]).mean())
    pipeline.schedule.step(*args)
    return 0.0


def forward(x: Tensor, y: Tensor, batch: int, pipeline: Pipeline) -> Tensor | None:
    """Forward through the pipeline (every stage calls it); the last stage gets the logits."""
    n = x.shape[0]
    if n < batch:  # a short last batch: pad with copies of its last row, then drop their logits
        x = torch.cat([x, x[-1:].expand(batch - n, *x.shape[1:])])
        y = torch.cat([y, y[-1:].expand(batch - n, *y.shape[1:])])
    args = (x,) if pipeline.is_first else ()
    if not pipeline.is_last:
        pipeline.schedule.eval(*args)
        return None
    return pipeline.schedule.eval(*args, target=y, losses=[])[:n]
