"""Memory: an estimate per rank before training, and an out-of-memory error that explains itself.

The estimate sizes parameters, gradients and optimizer state from the model's real shapes (built
on the meta device, so it costs no memory) and the layout's sharding; activations are measured
by running one sample through the meta model and adding up what autograd saves for backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models import ParallelPlan, parallel_plan
from rayjobs import log
from rayjobs.config import RunConfig
from rayjobs.context import WorkerContext
from rayjobs.errors import ExplainedFailure
from rayjobs.parallel import Layout, blocks_of, meta_model, microbatches

GIB = 2**30
MIB = 2**20


class OutOfMemory(ExplainedFailure):
    """A rank ran out of memory; the message says where, how much, and what to try."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at its peak, by kind (the largest pipeline stage when there are several)."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    micro_batch: int
    note: str = ""

    @property
    def total(self) -> float:
        """Parameters + gradients + optimizer state + activations."""
        return self.parameters + self.gradients + self.optimizer + self.activations

    @property
    def states(self) -> float:
        """Parameters + gradients + optimizer state (what FSDP shards)."""
        return self.parameters + self.gradients + self.optimizer

    def format(self, layout: Layout) -> str:
        """One line: each kind in MiB or GiB, and the total."""

        def size(b: float) -> str:
            return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / MIB:.1f} MiB"

        return (
            f"memory estimate per rank ({layout.describe()}): parameters {size(self.parameters)}, "
            f"gradients {size(self.gradients)}, optimizer {size(self.optimizer)}, activations "
            f"{size(self.activations)} (micro-batch {self.micro_batch}{', ' + self.note if self.note else ''}); "
            f"total {size(self.total)}"
        )


def _stage_of(name: str, layout: Layout, plan: ParallelPlan, block_names: list[str]) -> int | None:
    """The pipeline stage that holds parameter ``name`` (None: every stage, e.g. without pipelining)."""
    if layout.pp == 1:
        return None
    parts = name.split(".")
    if plan.layers_attr and name.startswith(plan.layers_attr + "."):
        index = block_names.index(name[len(plan.layers_attr) + 1 :].split(".")[0])
        bounds = layout.stage_bounds(len(block_names))
        return max(s for s in range(layout.pp) if bounds[s] <= index)
    if parts[0] in plan.pipeline_first:
        return 0
    return layout.pp - 1


def estimate(cfg: RunConfig, layout: Layout, use_gpu: bool) -> MemoryEstimate:
    """What one rank will hold at its peak for this config and layout."""
    model = meta_model(cfg)
    plan = parallel_plan(cfg.model.name)
    blocks = blocks_of(model, plan)
    block_names = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else []
    tp_sharded = {f"{m}.weight" for m in layout.tp_sharded(model, plan.tp_plan)}
    per_stage = [0.0] * layout.pp
    for name, p in model.named_parameters():
        elements = p.numel() / (layout.tp if name in tp_sharded else 1)
        if layout.sharded:
            elements /= layout.dp_shard
        stage = _stage_of(name, layout, plan, block_names)
        for s in range(layout.pp) if stage is None else [stage]:
            per_stage[s] += elements
    elements = max(per_stage)
    param_bytes = elements * 4  # fp32 master weights
    states_per_param, note = optimizer_states(cfg)

    local_batch = cfg.training.batch_size // max(1, layout.dp)
    if layout.pp > 1:
        mbs = microbatches(cfg.parallel, layout)
        micro_batch = local_batch // mbs
        in_flight = mbs if cfg.parallel.pp_schedule == "gpipe" else min(mbs, layout.pp)
    else:
        micro_batch, in_flight = local_batch // cfg.training.grad_accum, 1
    per_sample, per_block, block_input = activation_bytes(model, cfg, blocks)
    share = (len(block_names) / layout.pp if layout.pp > 1 else len(block_names)) / max(1, len(block_names))
    act = per_sample * share
    note = "measured on one sample" + note
    if cfg.parallel.activation_checkpointing != "none" and block_names:
        every = 1 if cfg.parallel.activation_checkpointing == "full" else cfg.parallel.ac_every
        wrapped = len(range(0, len(block_names), every)) * share
        act -= wrapped * (per_block - block_input)  # a wrapped block keeps only its input, recomputes the rest
        note += f", {cfg.parallel.activation_checkpointing} checkpointing"
    if layout.tp > 1:
        act -= per_block * len(block_names) * share * (1 - 1 / layout.tp)
    if cfg.training.precision in ("bf16", "fp16"):
        act /= 2
    return MemoryEstimate(
        parameters=param_bytes,
        gradients=param_bytes,
        optimizer=param_bytes * states_per_param,
        activations=max(act, 0.0) * micro_batch * in_flight,
        micro_batch=micro_batch,
        note=note,
    )


# Tensors of optimizer state per parameter (Adam's two moments; SGD's momentum buffer).
OPTIMIZER_STATES = {"adamw": 2, "torch.optim.Adam": 2, "torch.optim.AdamW": 2, "torch.optim.NAdam": 2,
                    "torch.optim.RAdam": 2, "torch.optim.Adamax": 2, "torch.optim.Adagrad": 1}  # fmt: skip


def optimizer_states(cfg: RunConfig) -> tuple[int, str]:
    """Tensors of state the optimizer keeps per parameter, and a note when it is a guess (AdamW's 2)."""
    o = cfg.optim
    if o.name == "sgd":
        return (1 if o.momentum else 0), ""
    if o.name in OPTIMIZER_STATES:
        return OPTIMIZER_STATES[o.name], ""
    return 2, f", {o.name}'s state counted as AdamW's"


def activation_bytes(model: nn.Module, cfg: RunConfig, blocks: Any) -> tuple[float, float, float]:
    """(bytes autograd saves for one sample, per block, a block's input), from a meta forward pass."""
    from rayjobs.data import data_info

    info = data_info(cfg.data.name, cfg.data.kwargs)
    if info.kind == "tokens":
        x = torch.zeros((1, *info.input_shape), dtype=torch.long, device="meta")
    else:
        x = torch.zeros((1, *info.input_shape), device="meta")
    params = {id(p) for p in model.parameters()}
    saved = {"total": 0.0, "block": 0.0, "input": 0.0}
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params:
            n = t.numel() * t.element_size()
            saved["total"] += n
            if inside[0]:
                saved["block"] += n
        return t

    hooks = []
    first = next(iter(blocks.values()), None) if isinstance(blocks, nn.ModuleDict) else None
    if first is not None:

        def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
            inside[0] = True
            saved["input"] = args[0].numel() * args[0].element_size()

        def leave(module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            inside[0] = False

        hooks = [first.register_forward_pre_hook(enter), first.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return saved["total"], saved["block"], saved["input"]


def warn_if_too_big(estimate_bytes: float | None, device: dict[str, Any], cfg: RunConfig) -> None:
    """Foresee an OOM: warn when the estimate exceeds 90% of the device's memory."""
    if not estimate_bytes or device["capability"] == "cpu":
        return
    if estimate_bytes > 0.9 * device["memory_gib"] * GIB:
        log.warn(
            f"the memory estimate ({estimate_bytes / GIB:.1f} GiB per rank) exceeds 90% of the "
            f"{device['memory_gib']} GiB of {device['name']}: expect an OOM; try a smaller micro-batch, "
            "parallel.strategy=fsdp, or parallel.activation_checkpointing=full"
        )


def is_oom(exc: BaseException) -> bool:
    """A CUDA OOM, or the CPU allocator refusing an allocation."""
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


def oom_message(exc: BaseException, ctx: WorkerContext, step: int, cfg: RunConfig, layout: Layout) -> str:
    """One line: which rank, at which step, the peak against the device, and what to try."""
    if ctx.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(ctx.device) / GIB
        total = torch.cuda.get_device_properties(ctx.device).total_memory / GIB
        where = f"peak {peak:.2f} GiB allocated of {total:.1f} GiB on {torch.cuda.get_device_name(ctx.device)}"
    else:
        import psutil

        rss = psutil.Process().memory_info().rss / GIB
        where = f"process RSS {rss:.2f} GiB of {psutil.virtual_memory().total / GIB:.1f} GiB RAM"
    tries = ["a smaller micro-batch (training.batch_size, or more training.grad_accum)"]
    if not layout.sharded:
        tries.append("parallel.strategy=fsdp (shards parameters, gradients and optimizer state)")
    if cfg.parallel.activation_checkpointing != "full":
        tries.append("parallel.activation_checkpointing=full")
    if layout.sharded and not cfg.parallel.cpu_offload and ctx.device.type == "cuda":
        tries.append("parallel.cpu_offload=true")
    first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
    return f"rank {ctx.rank} ran out of memory at step {step} ({where}; {first}); try {'; or '.join(tries)}"
