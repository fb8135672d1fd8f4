"""One optimizer step and one evaluation pass: the pieces of the loop that run on every rank.

Plain functions over a model, its optimizer and a ``WorkerContext``: tested without Ray in
multi-process gloo tests, and timed by the benchmarks.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from rayjobs import data as data_lib
from rayjobs import parallel
from rayjobs.config import RunConfig
from rayjobs.context import WorkerContext, all_reduce_sum
from rayjobs.parallel import pp
from rayjobs.tasks import Classification, Task, metric_inputs, metric_objects

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def micro_batch_size(global_batch: int, world_size: int, grad_accum: int) -> int:
    """Samples per forward pass on one worker; the global batch must divide evenly."""
    parts = world_size * grad_accum
    if global_batch % parts:
        raise ValueError(f"training.batch_size={global_batch} must be a multiple of workers x grad_accum = {parts}")
    return global_batch // parts


def autocast(cfg: RunConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Mixed-precision autocast for bf16/fp16; nothing for fp32."""
    dtype = PRECISION_DTYPES.get(cfg.training.precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass
class StepResult:
    """What one optimizer step produced; ``finite`` is agreed across ranks."""

    loss: float
    grad_norm: float
    finite: bool = True
    bad_ranks: list[int] = field(default_factory=list)
    at_step: int = 0  # the first step whose loss was not finite, when a LossWindow found it later
    pending: tuple[Tensor, Tensor] | None = None  # lean: (this rank's loss, the grad norm), still on the device


def train_step(
    model: nn.Module,
    micro_batches: Sequence[tuple[Tensor, Tensor]],
    optimizer: torch.optim.Optimizer,
    cfg: RunConfig,
    ctx: WorkerContext,
    scaler: torch.amp.GradScaler | None = None,
    inject_nan: bool = False,
    pipeline: pp.Pipeline | None = None,
    task: Task | None = None,
    lean: bool = False,
) -> StepResult:
    """One optimizer step over ``grad_accum`` equal micro-batches, with ``task``'s loss (default: classification).

    Each micro-batch loss is a mean over its samples, divided by the number of micro-batches, so
    the summed gradient equals the gradient of the mean loss over the whole local batch; DDP then
    averages over ranks, giving exactly the gradient of one large global batch. Gradients are
    all-reduced only on the last micro-batch (``no_sync`` before it). A non-finite loss on any
    rank is agreed on by all ranks (an all-reduce of the flags); the step is then not taken. The
    loss returned is the mean over the data-parallel replicas. With a pipeline, the micro-batches
    form one batch that the schedule splits into ``parallel.microbatches`` itself.

    ``lean`` (no pipeline, no loss scaling): nothing waits for the device. The loss and the gradient
    norm stay tensors (``StepResult.pending``), clipping is done on the device, and the step is taken
    even if a loss is not finite: a ``LossWindow`` finds that later, before anything is saved.
    """
    model.train()
    task = task or Classification()
    scaling = scaler is not None and scaler.is_enabled()
    lean = lean and pipeline is None and not scaling
    if pipeline is not None:
        total = pp.forward_backward(micro_batches, pipeline, ctx)
    else:
        total = torch.zeros((), dtype=torch.float64, device=ctx.device) if lean else 0.0
        accum = len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            with gradient_sync(model, i == accum - 1), autocast(cfg, ctx.device):
                loss = task.loss(model(x), y) / accum
                if inject_nan and i == accum - 1:
                    loss = loss * float("nan")
            (scaler.scale(loss) if scaling else loss).backward()
            total += loss.detach() if lean else loss.item()
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    if lean:
        grad_norm = parallel.clip_grad_norm(model, clip, None, lazy=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return StepResult(math.nan, math.nan, pending=(total, grad_norm))
    total, bad_ranks = agree_on_loss(total, ctx)
    if bad_ranks:
        optimizer.zero_grad(set_to_none=True)
        return StepResult(total, float("nan"), finite=False, bad_ranks=bad_ranks)
    if scaling:
        scaler.unscale_(optimizer)
    grad_norm = parallel.clip_grad_norm(model, clip, pipeline)
    if scaling:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(total, grad_norm)


def gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[Any]:
    """Reduce gradients only on the last micro-batch: DDP's ``no_sync``, FSDP2's gradient-sync switch."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync or not hasattr(model, "no_sync") else model.no_sync()


def agree_on_loss(local: float, ctx: WorkerContext) -> tuple[float, list[int]]:
    """(mean loss over the replicas, ranks whose loss was not finite): one all-reduce, known to every rank."""
    finite = math.isfinite(local)
    if ctx.world_size == 1 or not dist.is_initialized():
        return local, [] if finite else [ctx.rank]
    buf = torch.zeros(ctx.world_size + 1, dtype=torch.float64, device=ctx.device)
    buf[ctx.rank] = 0.0 if finite else 1.0
    buf[-1] = local if finite and ctx.counts_metrics else 0.0
    dist.all_reduce(buf)
    values = buf.tolist()
    bad = [r for r, f in enumerate(values[:-1]) if f > 0]
    return (float("nan") if bad else values[-1] / ctx.data_shard[1]), bad


class LossWindow:
    """The lean loop's losses since its last check, kept on the device: no host sync per step.

    ``check`` agrees across ranks in one all-reduce on the first step whose loss was not finite (and
    on which ranks), and on the mean over data-parallel replicas of the steps' losses.
    """

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses: list[Tensor] = []
        self.grad_norm: Tensor | None = None

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, step: int, result: StepResult) -> None:
        """Keep a lean step's pending loss (the gradient norm of the newest step only)."""
        assert result.pending is not None
        self.steps.append(step)
        self.losses.append(result.pending[0])
        self.grad_norm = result.pending[1]

    def check(self, ctx: WorkerContext) -> tuple[StepResult, float]:
        """(the newest step's result, the sum of the window's replica-mean losses); the window empties.

        A non-finite loss gives ``finite=False`` with ``at_step`` its first step and ``bad_ranks``
        the ranks whose loss was not finite at that step.
        """
        local = torch.stack(self.losses)
        bad = (~torch.isfinite(local)).double()
        first_bad = torch.where(bad.any(), bad.argmax() + 1, 0)  # 1-based index in the window; 0: none
        buf = torch.zeros(ctx.world_size + 2, dtype=torch.float64, device=local.device)
        buf[ctx.rank] = first_bad  # each rank writes its own slot: the sum is the table of every rank's
        if ctx.counts_metrics:
            buf[-2], buf[-1] = local[-1], local.sum()
        if ctx.world_size > 1 and dist.is_initialized():
            dist.all_reduce(buf)
        values = buf.tolist()
        grad_norm = float(self.grad_norm) if self.grad_norm is not None else math.nan
        steps, shards = self.steps, ctx.data_shard[1]
        self.steps, self.losses, self.grad_norm = [], [], None
        firsts = [int(v) for v in values[: ctx.world_size]]
        if any(firsts):
            first = min(f for f in firsts if f)
            ranks = [r for r, f in enumerate(firsts) if f == first]
            return StepResult(math.nan, math.nan, finite=False, bad_ranks=ranks, at_step=steps[first - 1]), 0.0
        return StepResult(values[-2] / shards, grad_norm), values[-1] / shards


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Any,
    cfg: RunConfig,
    ctx: WorkerContext,
    prefix: str,
    pipeline: pp.Pipeline | None = None,
    task: Task | None = None,
) -> dict[str, float]:
    """``task``'s metrics over ``dataset`` (default: classification's loss and accuracy): each replica
    takes a strided share, one rank per replica sums it, and the sums are all-reduced."""
    model.eval()
    task = task or Classification()
    totals: dict[str, float] = {}
    objects = {name: m.to(ctx.device) for name, m in metric_objects(task).items()}  # a user's torchmetrics
    shard, shards = ctx.data_shard
    # A pipeline's stages were shaped for the training batch: evaluate in batches of that size.
    batch = cfg.training.batch_size // shards if pipeline else max(64, cfg.training.batch_size)
    for x, y in data_lib.eval_batches(dataset, shard, shards, batch):
        x, y = x.to(ctx.device), y.to(ctx.device)
        if pipeline is not None:
            output = pp.forward(x, y, batch, pipeline)
        else:
            with autocast(cfg, ctx.device):
                output = model(x)
        if output is None or not ctx.counts_metrics:
            continue
        for key, value in task.sums(output.float(), y).items():
            totals[key] = totals.get(key, 0.0) + float(value)
        for m in objects.values():
            m.update(*metric_inputs(task, output.float(), y))
    keys = _all_keys(totals, ctx)
    summed = all_reduce_sum([totals.get(k, 0.0) for k in keys], ctx)
    model.train()
    metrics = task.finish(dict(zip(keys, summed)))
    metrics.update({name: float(m.compute()) for name, m in objects.items()})  # synced over the ranks
    return {f"{prefix}/{name}": float(value) for name, value in metrics.items()}


def _all_keys(totals: dict[str, float], ctx: WorkerContext) -> list[str]:
    """The names of the sums, the same on every rank (a rank that counted nothing has none of its own)."""
    if ctx.world_size == 1 or not dist.is_initialized():
        return sorted(totals)
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, sorted(totals))
    return sorted({k for keys in gathered for k in keys})


def param_groups(model: nn.Module, cfg: RunConfig) -> list[dict[str, Any]]:
    """The trainable parameters in groups: weight decay on matrices (linear, conv, embedding weights),
    none on 1-D tensors (biases, norm weights; ``no_decay``) unless ``optim.decay_norms_and_biases``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optim.decay_norms_and_biases:
        return [{"params": params}]
    decay, no_decay = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    groups: list[dict[str, Any]] = [{"params": decay}] if decay else []
    return groups + ([{"params": no_decay, "weight_decay": 0.0, "no_decay": True}] if no_decay else [])


def build_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """``cfg.optim``'s optimizer over ``param_groups``: AdamW, SGD, ``torch.optim.<Name>``, or a user's
    callable (called with the groups, ``lr=``, ``weight_decay=`` and ``optim.kwargs``)."""
    o = cfg.optim
    groups = param_groups(model, cfg)
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, **o.kwargs)
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=o.lr, weight_decay=o.weight_decay, **o.kwargs)
    if o.name.startswith("torch.optim."):
        factory = getattr(torch.optim, o.name.removeprefix("torch.optim."))
    else:
        from models.registry import resolve_callable

        factory = resolve_callable(o.name)
    optimizer = factory(groups, lr=o.lr, weight_decay=o.weight_decay, **o.kwargs)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optim.name={o.name} returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    return optimizer


def lr_factor(step: int, cfg: RunConfig, total_steps: int) -> float:
    """Multiplier of the peak LR at ``step``: linear warmup, then constant, cosine or linear decay."""
    warmup = cfg.optim.warmup_steps
    if warmup and step < warmup:
        return (step + 1) / warmup
    if cfg.optim.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if cfg.optim.schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: RunConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of ``cfg.optim`` over ``total_steps`` optimizer steps."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))
    scheduler.total_steps = total_steps  # type: ignore[attr-defined]
    return scheduler
