"""Parallelism applied from outside the model, in torchtitan's order.

A ``Layout`` is the resolved ``parallel:`` config: four degrees (pipeline stages, replicas, shards,
tensor-parallel ranks) whose product is the world size. ``apply`` turns a plain model into this
rank's part of the job: a device mesh, then a pipeline stage (the model minus the other stages'
parts), tensor parallelism from the spec's TP plan, activation checkpointing, ``torch.compile``
per block, and data parallelism last (FSDP2 ``fully_shard``, DDP, or ``nn.DataParallel``).
Models keep their TP plans and pipeline split points as data in ``ModelSpec.extra``.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rayjobs.config import ParallelSection, RunConfig
from rayjobs.parallel import WorkerContext

# Which degrees a strategy may set above 1, and the one it derives from the world size.
_ALLOWED = {
    "ddp": ({"dp_replicate"}, "dp_replicate"),
    "fsdp": ({"dp_shard"}, "dp_shard"),
    "hsdp": ({"dp_replicate", "dp_shard"}, "dp_shard"),
    "tp": ({"tp"}, "tp"),
    "pp": ({"pp"}, "pp"),
    "fsdp+tp": ({"dp_replicate", "dp_shard", "tp"}, "dp_shard"),
    "pp+dp": ({"pp", "dp_replicate"}, "dp_replicate"),
    "dataparallel": (set(), ""),
}
_DEFAULTS = {"hsdp": {"dp_replicate": 2}, "fsdp+tp": {"tp": 2}, "pp+dp": {"pp": 2}}
DEGREES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Layout:
    """The resolved degrees of a run; their product is the world size."""

    strategy: str
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        """pp x dp_replicate x dp_shard x tp."""
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 shards parameters, gradients and optimizer state."""
        return self.strategy in ("fsdp", "hsdp", "fsdp+tp")

    def describe(self) -> str:
        """``fsdp+tp: dp_shard=2 x tp=2`` (the degrees above 1)."""
        parts = [f"{d}={getattr(self, d)}" for d in DEGREES if getattr(self, d) > 1]
        return f"{self.strategy}: {' x '.join(parts) or 'one rank'}"


def resolve_layout(p: ParallelSection, world_size: int) -> Layout:
    """The degrees for this strategy and world size (ValueError naming the field when they do not fit)."""
    allowed, derived = _ALLOWED[p.strategy]
    if p.strategy == "dataparallel":
        if world_size > 1:
            raise ValueError(
                f"parallel.strategy=dataparallel: one worker drives all GPUs of its node, but the run has "
                f"{world_size} workers; set scaling.num_workers=1, or use strategy ddp"
            )
        return Layout("dataparallel")
    degrees = {d: getattr(p, d) for d in DEGREES}
    for d, v in degrees.items():
        if v > 1 and d not in allowed:
            fits = [s for s, (a, _) in _ALLOWED.items() if d in a]
            raise ValueError(f"parallel.{d}={v} does not apply to strategy {p.strategy}; use {' or '.join(fits)}")
    for d, v in _DEFAULTS.get(p.strategy, {}).items():
        if not degrees[d]:
            degrees[d] = v if world_size % v == 0 and world_size >= v else 1
    rest = math.prod(v or 1 for d, v in degrees.items() if d != derived)
    if not degrees[derived]:
        if world_size % rest:
            raise ValueError(
                f"parallel: {' x '.join(f'{d}={v}' for d, v in degrees.items() if v)} = {rest} does not divide "
                f"the world size {world_size} (scaling.num_workers)"
            )
        degrees[derived] = world_size // rest
    layout = Layout(p.strategy, **{d: v or 1 for d, v in degrees.items()})
    if layout.world_size != world_size:
        raise ValueError(
            f"parallel: pp x dp_replicate x dp_shard x tp = {layout.world_size}, but the world size is "
            f"{world_size} (scaling.num_workers); make them multiply to {world_size}"
        )
    return layout


def layout_problems(cfg: RunConfig, world_size: int, use_gpu: bool) -> list[str]:
    """Every reason this parallel config cannot run at this world size: one line each, before Ray starts."""
    try:
        layout = resolve_layout(cfg.parallel, world_size)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    p = cfg.parallel
    needs_spec = layout.tp > 1 or layout.pp > 1
    spec = _spec(cfg)
    if needs_spec and spec is None:
        return [
            f"parallel.strategy={p.strategy}: {cfg.model.name} is not a registry model with a TP plan and pipeline split"
        ]
    if layout.tp > 1 or layout.pp > 1 or p.activation_checkpointing != "none":
        model = meta_model(cfg)
        if layout.tp > 1:
            if "tp_plan" not in spec.extra:
                problems.append(f"parallel.tp={layout.tp}: {cfg.model.name} has no tensor-parallel plan")
            heads = getattr(model, "n_heads", None)
            if heads and heads % layout.tp:
                problems.append(f"parallel.tp={layout.tp} must divide the model's {heads} attention heads")
        if layout.pp > 1:
            blocks = _blocks(model, spec)
            if "pipeline" not in spec.extra or blocks is None:
                problems.append(f"parallel.pp={layout.pp}: {cfg.model.name} has no pipeline split points")
            elif layout.pp > len(blocks):
                problems.append(
                    f"parallel.pp={layout.pp} stages, but {cfg.model.name}/{cfg.model.flavor or 'default'} has "
                    f"{len(blocks)} layers; use at most {len(blocks)}"
                )
            local = cfg.training.batch_size // max(1, layout.dp)
            mbs = microbatches(p, layout)
            if local % mbs:
                problems.append(
                    f"parallel.microbatches={mbs} must divide the per-replica batch {local} "
                    f"(training.batch_size={cfg.training.batch_size} / {layout.dp} replicas)"
                )
            if cfg.training.grad_accum > 1:
                problems.append(
                    "training.grad_accum: a pipeline accumulates through parallel.microbatches; set grad_accum=1"
                )
        if p.activation_checkpointing != "none" and (spec is None or _blocks(model, spec) is None):
            problems.append(f"parallel.activation_checkpointing: {cfg.model.name} has no blocks (layers_attr) to wrap")
    if p.cpu_offload and not (layout.sharded and use_gpu):
        problems.append("parallel.cpu_offload needs an FSDP strategy (fsdp, hsdp, fsdp+tp) on GPUs")
    return problems


def microbatches(p: ParallelSection, layout: Layout) -> int:
    """Pipeline micro-batches per step: the configured number, or two per stage."""
    return p.microbatches or 2 * layout.pp


def meta_model(cfg: RunConfig) -> nn.Module:
    """The model with its real shapes and no memory (on the meta device), to check and size it."""
    from models import build_model
    from rayjobs.data import data_info

    with torch.device("meta"):
        return build_model(
            cfg.model.name, cfg.model.flavor, cfg.model.kwargs, data_info(cfg.data.name, cfg.data.kwargs)
        )


def _spec(cfg: RunConfig) -> Any:
    from models.registry import get_spec, is_import_path

    return None if is_import_path(cfg.model.name) else get_spec(cfg.model.name)


def _blocks(model: nn.Module, spec: Any) -> nn.ModuleDict | nn.ModuleList | None:
    attr = spec.extra.get("layers_attr") if spec is not None else None
    blocks = getattr(model, attr, None) if attr else None
    return blocks if isinstance(blocks, (nn.ModuleDict, nn.ModuleList)) else None


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


@dataclass
class Parallelized:
    """This rank's model after ``apply``, with its place in the layout."""

    model: nn.Module
    ctx: WorkerContext
    layout: Layout
    pipeline: Pipeline | None = None
    mesh: Any = None


def build_mesh(layout: Layout, ctx: WorkerContext) -> Any:
    """A 4-D device mesh (pp, dp_replicate, dp_shard, tp): tensor-parallel ranks are adjacent."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, tuple(getattr(layout, d) for d in DEGREES), mesh_dim_names=DEGREES)


def place(cfg: RunConfig, ctx: WorkerContext) -> tuple[WorkerContext, Layout]:
    """This rank's place in the layout: its data shard, and whether it counts loss and accuracy."""
    layout = resolve_layout(cfg.parallel, ctx.world_size)
    coords = _coordinates(layout, ctx.rank)
    ctx = replace(
        ctx,
        dp_rank=coords["dp_replicate"] * layout.dp_shard + coords["dp_shard"],
        dp_size=layout.dp,
        counts_metrics=coords["tp"] == 0 and coords["pp"] == layout.pp - 1,
    )
    return ctx, layout


def apply(model: nn.Module, cfg: RunConfig, ctx: WorkerContext, layout: Layout, loss_fn: Any = None) -> Parallelized:
    """Make ``model`` this rank's part: stage, TP, activation checkpointing, compile, then FSDP2/DDP."""
    spec = _spec(cfg)
    mesh = build_mesh(layout, ctx) if dist.is_available() and dist.is_initialized() else None
    stage = _coordinates(layout, ctx.rank)["pp"]
    if layout.pp > 1:
        model = pipeline_stage(model, spec, stage, layout.pp)
    if layout.tp > 1:
        apply_tensor_parallel(model, spec.extra["tp_plan"], mesh["tp"])
    if cfg.parallel.activation_checkpointing != "none":
        apply_activation_checkpointing(model, spec, cfg.parallel.activation_checkpointing, cfg.parallel.ac_every)
    if cfg.parallel.compile:
        blocks = _blocks(model, spec)
        for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else (blocks or [model]):
            block.compile()
    model = apply_data_parallel(model, cfg, layout, mesh, ctx, spec)
    pipeline = None
    if layout.pp > 1:
        pipeline = _schedule(model, cfg, layout, stage, mesh["pp"].get_group(), ctx, loss_fn)
    return Parallelized(model, ctx, layout, pipeline, mesh)


def _coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """This rank's index along each mesh dimension (row-major over DEGREES, tp fastest)."""
    coords = {}
    for d in reversed(DEGREES):
        size = getattr(layout, d)
        coords[d], rank = rank % size, rank // size
    return coords


def pipeline_stage(model: nn.Module, spec: Any, stage: int, stages: int) -> nn.Module:
    """The model minus the other stages' parts: an even share of the blocks, embeddings on the first
    stage, the head on the last. Parameter names are unchanged, so DCP checkpoints match."""
    blocks = _blocks(model, spec)
    names = list(blocks.keys())
    per, extra = divmod(len(names), stages)
    start = stage * per + min(stage, extra)
    keep = set(names[start : start + per + (1 if stage < extra else 0)])
    for name in names:
        if name not in keep:
            del blocks[name]
    split = spec.extra["pipeline"]
    for attr in split["first"] if stage > 0 else []:
        setattr(model, attr, None)
    for attr in split["last"] if stage < stages - 1 else []:
        setattr(model, attr, None)
    return model


def apply_tensor_parallel(model: nn.Module, plan: dict[str, str], tp_mesh: Any) -> None:
    """Column- and row-wise sharding of the modules the plan names (``*`` matches one name)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    resolved = {}
    for fqn, _ in model.named_modules():
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(fqn, pattern) and fqn.count(".") == pattern.count("."):
                resolved[fqn] = styles[style]()
    parallelize_module(model, tp_mesh, resolved)


def apply_activation_checkpointing(model: nn.Module, spec: Any, mode: str, every: int) -> None:
    """Wrap every block (full) or every ``every``-th block (selective) to recompute it in backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = _blocks(model, spec)
    for i, name in enumerate(list(blocks.keys())):
        if mode == "full" or i % every == 0:
            blocks[name] = checkpoint_wrapper(blocks[name], preserve_rng_state=False)


def apply_data_parallel(
    model: nn.Module, cfg: RunConfig, layout: Layout, mesh: Any, ctx: WorkerContext, spec: Any
) -> nn.Module:
    """FSDP2 over the shard (and replicate) dimensions, DDP over replicas, or nn.DataParallel."""
    if layout.strategy == "dataparallel":
        return _data_parallel_module(model, ctx)
    if mesh is None:
        return model
    if layout.sharded:  # also on one rank: FSDP2's mixed-precision policy (bf16 params) still applies
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        dims = ("dp_replicate", "dp_shard") if layout.dp_replicate > 1 else ("dp_shard",)
        dp_mesh = mesh[dims]
        dtype = cfg.parallel.fsdp_param_dtype
        bf16 = dtype == "bf16" or (dtype == "auto" and ctx.device.type == "cuda")
        kwargs: dict[str, Any] = {
            "mesh": dp_mesh,
            # bf16 compute with fp32 gradient reduction; otherwise everything in the parameters' dtype.
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy(),
        }
        if cfg.parallel.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        blocks = _blocks(model, spec)
        for block in (blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks) if blocks is not None else []:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model
    if layout.dp == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=mesh["dp_replicate"].get_group())


def _data_parallel_module(model: nn.Module, ctx: WorkerContext) -> nn.Module:
    from rayjobs.loop import log

    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    log(
        f"parallel.strategy=dataparallel: one process drives {max(gpus, 1)} device(s) through nn.DataParallel; "
        "prefer ddp (one process per GPU): it overlaps gradient all-reduce with backward and has no GIL bottleneck"
    )
    return nn.DataParallel(model) if gpus > 1 else model


def _schedule(
    model: nn.Module, cfg: RunConfig, layout: Layout, stage: int, group: Any, ctx: WorkerContext, loss_fn: Any
) -> Pipeline:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mbs = microbatches(cfg.parallel, layout)
    pstage = PipelineStage(model, stage, layout.pp, ctx.device, group=group)
    cls = Schedule1F1B if cfg.parallel.pp_schedule == "1f1b" else ScheduleGPipe
    schedule = cls(pstage, n_microbatches=mbs, loss_fn=loss_fn)
    return Pipeline(schedule, stage, layout.pp, mbs, group)


def clip_grad_norm(model: nn.Module, max_norm: float, pipeline: Pipeline | None) -> float:
    """The global gradient norm (DTensor shards and pipeline stages included), clipped to ``max_norm``."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float64, device=_device_of(params))
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if isinstance(p.grad, DTensor):
            by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)
        else:
            squares += torch.linalg.vector_norm(p.grad.detach(), 2, dtype=torch.float64) ** 2
    for grads in by_mesh.values():  # one collective per mesh: the norms of the shards are reduced together
        local = torch.stack([torch.linalg.vector_norm(g.detach(), 2) for g in grads])
        total = torch.linalg.vector_norm(local, 2)
        squares += (total.full_tensor() if isinstance(total, DTensor) else total).double() ** 2
    if pipeline is not None:
        dist.all_reduce(squares, group=pipeline.group)
    norm = float(squares.sqrt())
    coef = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_ does
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
    return norm


def _device_of(params: list[torch.Tensor]) -> torch.device:
    from torch.distributed.tensor import DTensor

    for p in params:
        return p.to_local().device if isinstance(p, DTensor) else p.device
    return torch.device("cpu")
