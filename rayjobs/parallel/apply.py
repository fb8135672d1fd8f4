"""Parallelism applied from outside the model, in torchtitan's order, and what is checked before it.

``apply`` turns a plain model into this rank's part of the job: a device mesh, then a pipeline
stage, tensor parallelism from the model's ``ParallelPlan``, activation checkpointing,
``torch.compile`` per block, and data parallelism last (FSDP2, DDP, or ``nn.DataParallel``).
``layout_problems`` says, before Ray starts, every reason a layout cannot run a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from models import ParallelPlan, build_model, is_import_path, parallel_plan
from models.hf import is_hf
from rayjobs.config import RunConfig
from rayjobs.context import WorkerContext
from rayjobs.parallel import ddp, fsdp, pp, tp
from rayjobs.parallel.layout import DEGREES, Layout, microbatches, resolve_layout


@dataclass
class Parallelized:
    """This rank's model after ``apply``, with its place in the layout."""

    model: nn.Module
    ctx: WorkerContext
    layout: Layout
    pipeline: pp.Pipeline | None = None
    mesh: Any = None


def blocks_of(model: nn.Module, plan: ParallelPlan) -> nn.ModuleDict | nn.ModuleList | None:
    """The model's repeated blocks (the plan's ``layers_attr``, a dotted path), or None."""
    if not plan.layers_attr:
        return None
    try:
        blocks = model.get_submodule(plan.layers_attr)
    except AttributeError:
        return None
    return blocks if isinstance(blocks, (nn.ModuleDict, nn.ModuleList)) else None


def meta_model(cfg: RunConfig) -> nn.Module:
    """The model with its real shapes and no memory (on the meta device), to check and size it."""
    from rayjobs.data import data_info

    with torch.device("meta"):
        return build_model(
            cfg.model.name, cfg.model.flavor, cfg.model.kwargs, data_info(cfg.data.name, cfg.data.kwargs)
        )


def layout_problems(cfg: RunConfig, world_size: int, use_gpu: bool) -> list[str]:
    """Every reason this parallel config cannot run at this world size: one line each, before Ray starts."""
    try:
        layout = resolve_layout(cfg.parallel, world_size)
    except ValueError as exc:
        return [str(exc)]
    p, plan = cfg.parallel, parallel_plan(cfg.model.name)
    if is_hf(cfg.model.name) and (layout.tp > 1 or layout.pp > 1):
        return [
            f"parallel.strategy={p.strategy}: {cfg.model.name} trains under ddp, fsdp and hsdp; tensor and "
            "pipeline parallel need a plan that a transformers model does not carry here"
        ]
    if (layout.tp > 1 and not plan.tp_plan) or (layout.pp > 1 and not plan.can_pipeline):
        if is_import_path(cfg.model.name):
            return [
                f"parallel.strategy={p.strategy}: {cfg.model.name} carries no parallel plan for it; give the "
                f"builder one: {cfg.model.name.rsplit(':', 1)[-1]}.parallel_plan = models.ParallelPlan(layers_attr=..., "
                "tp_plan={...}, pipeline_first=(...), pipeline_last=(...))"
            ]
    problems = []
    if layout.tp > 1 or layout.pp > 1 or p.activation_checkpointing != "none":
        model = meta_model(cfg)
        blocks = blocks_of(model, plan)
        if layout.tp > 1:
            problems += _tp_problems(cfg, layout, model, plan)
        if layout.pp > 1:
            problems += _pp_problems(cfg, layout, blocks)
        if p.activation_checkpointing != "none" and blocks is None:
            problems.append(f"parallel.activation_checkpointing: {cfg.model.name} has no blocks (layers_attr) to wrap")
    if p.cpu_offload and not (layout.sharded and use_gpu):
        problems.append("parallel.cpu_offload needs an FSDP strategy (fsdp, hsdp, fsdp+tp) on GPUs")
    return problems


def _tp_problems(cfg: RunConfig, layout: Layout, model: nn.Module, plan: ParallelPlan) -> list[str]:
    if not plan.tp_plan:
        return [f"parallel.tp={layout.tp}: {cfg.model.name} has no tensor-parallel plan"]
    heads = getattr(model, "n_heads", None)
    if heads and heads % layout.tp:
        return [f"parallel.tp={layout.tp} must divide the model's {heads} attention heads"]
    return []


def _pp_problems(cfg: RunConfig, layout: Layout, blocks: Any) -> list[str]:
    problems = []
    if blocks is None:
        problems.append(f"parallel.pp={layout.pp}: {cfg.model.name} has no pipeline split points")
    elif layout.pp > len(blocks):
        problems.append(
            f"parallel.pp={layout.pp} stages, but {cfg.model.name}/{cfg.model.flavor or 'default'} has "
            f"{len(blocks)} layers; use at most {len(blocks)}"
        )
    local = cfg.training.batch_size // max(1, layout.dp)
    mbs = microbatches(cfg.parallel, layout)
    if local % mbs:
        problems.append(
            f"parallel.microbatches={mbs} must divide the per-replica batch {local} "
            f"(training.batch_size={cfg.training.batch_size} / {layout.dp} replicas)"
        )
    if cfg.training.grad_accum > 1:
        problems.append("training.grad_accum: a pipeline accumulates through parallel.microbatches; set grad_accum=1")
    return problems


def place(cfg: RunConfig, ctx: WorkerContext) -> tuple[WorkerContext, Layout]:
    """This rank's place in the layout: its data shard, and whether it counts loss and accuracy."""
    layout = resolve_layout(cfg.parallel, ctx.world_size)
    coords = layout.coordinates(ctx.rank)
    ctx = replace(
        ctx,
        dp_rank=coords["dp_replicate"] * layout.dp_shard + coords["dp_shard"],
        dp_size=layout.dp,
        counts_metrics=coords["tp"] == 0 and coords["pp"] == layout.pp - 1,
    )
    return ctx, layout


def build_mesh(layout: Layout, ctx: WorkerContext) -> Any:
    """A 4-D device mesh (pp, dp_replicate, dp_shard, tp): tensor-parallel ranks are adjacent."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, tuple(getattr(layout, d) for d in DEGREES), mesh_dim_names=DEGREES)


def apply(model: nn.Module, cfg: RunConfig, ctx: WorkerContext, layout: Layout, loss_fn: Any = None) -> Parallelized:
    """Make ``model`` this rank's part: stage, TP, activation checkpointing, compile, then FSDP2/DDP."""
    plan = parallel_plan(cfg.model.name)
    mesh = build_mesh(layout, ctx) if dist.is_available() and dist.is_initialized() else None
    stage = layout.coordinates(ctx.rank)["pp"]
    if layout.pp > 1:
        model = pp.pipeline_stage(model, blocks_of(model, plan), plan, stage, layout)
    if layout.tp > 1:
        tp.apply_tensor_parallel(model, plan.tp_plan, mesh["tp"], layout)
    if cfg.parallel.activation_checkpointing != "none":
        apply_activation_checkpointing(
            blocks_of(model, plan), cfg.parallel.activation_checkpointing, cfg.parallel.ac_every
        )
    if cfg.parallel.compile:
        blocks = blocks_of(model, plan)
        for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else (blocks or [model]):
            block.compile()
    model = apply_data_parallel(model, cfg, layout, mesh, ctx, plan)
    pipeline = None
    if layout.pp > 1:
        mbs = microbatches(cfg.parallel, layout)
        group = mesh["pp"].get_group()
        pipeline = pp.build_schedule(model, stage, layout, mbs, cfg.parallel.pp_schedule, group, ctx, loss_fn)
    return Parallelized(model, ctx, layout, pipeline, mesh)


def apply_activation_checkpointing(blocks: Any, mode: str, every: int) -> None:
    """Wrap every block (full) or every ``every``-th block (selective) to recompute it in backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, name in enumerate(list(blocks.keys())):
        if mode == "full" or i % every == 0:
            blocks[name] = checkpoint_wrapper(blocks[name], preserve_rng_state=False)


def apply_data_parallel(
    model: nn.Module, cfg: RunConfig, layout: Layout, mesh: Any, ctx: WorkerContext, plan: ParallelPlan
) -> nn.Module:
    """FSDP2 over the shard (and replicate) dimensions, DDP over replicas, or nn.DataParallel."""
    if layout.strategy == "dataparallel":
        return ddp.wrap_data_parallel_module(model, ctx)
    if mesh is None:
        return model
    if layout.sharded:
        dims = ("dp_replicate", "dp_shard") if layout.dp_replicate > 1 else ("dp_shard",)
        p = cfg.parallel
        return fsdp.apply_fsdp(model, mesh[dims], blocks_of(model, plan), p.fsdp_param_dtype, p.cpu_offload, ctx)
    if layout.dp == 1:
        return model
    return ddp.wrap_ddp(model, ctx, process_group=mesh["dp_replicate"].get_group())


def clip_grad_norm(
    model: nn.Module, max_norm: float, pipeline: pp.Pipeline | None, lazy: bool = False
) -> float | torch.Tensor:
    """The global gradient norm (DTensor shards and pipeline stages included), clipped to ``max_norm``.

    ``lazy``: the norm stays a tensor and the clip is applied on the device (no host sync), the
    way ``torch.nn.utils.clip_grad_norm_`` does it.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float64, device=_device_of(params))
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    plain: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        if isinstance(p.grad, DTensor):
            by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)
        else:
            plain.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad.detach())
    for (dtype, _), grads in plain.items():  # one fused kernel per group, not three small ops per parameter
        # Each tensor's norm in fp32 at least (asking for fp64 takes a slow path); their sum in fp64.
        wide = None if dtype in (torch.float32, torch.float64) else torch.float32
        norms = torch.stack(torch._foreach_norm(grads, 2, dtype=wide)).double()
        squares += norms.square().sum().to(squares.device)
    for grads in by_mesh.values():  # one collective per mesh: the norms of the shards are reduced together
        local = torch.stack([torch.linalg.vector_norm(g.detach(), 2) for g in grads])
        total = torch.linalg.vector_norm(local, 2)
        squares += (total.full_tensor() if isinstance(total, DTensor) else total).double() ** 2
    if pipeline is not None:
        dist.all_reduce(squares, group=pipeline.group)
    if lazy:
        norm_t = squares.sqrt()
        if math.isfinite(max_norm):
            _scale_on_device([p.grad for p in params], torch.clamp(max_norm / (norm_t + 1e-6), max=1.0))
        return norm_t
    norm = float(squares.sqrt())
    coef = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_ does
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
    return norm


def _scale_on_device(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every gradient (a DTensor's local shard) by the 0-dim ``coef``, grouped by dtype and device."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        local = g.detach().to_local() if isinstance(g, DTensor) else g.detach()
        groups.setdefault((local.dtype, local.device), []).append(local)
    for (dtype, device), tensors in groups.items():
        torch._foreach_mul_(tensors, coef.to(dtype=dtype, device=device))


def _device_of(params: list[torch.Tensor]) -> torch.device:
    from torch.distributed.tensor import DTensor

    for p in params:
        return p.to_local().device if isinstance(p, DTensor) else p.device
    return torch.device("cpu")
