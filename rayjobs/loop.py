"""The per-worker training function, in numbered steps: data, model, loop, eval, report.

``train_fn_per_worker`` runs on every Ray Train worker (and in local mode in the driver). The
pieces it is built from (``train_step``, ``evaluate``, ``build_optimizer``) are plain functions,
tested without Ray in multi-process gloo tests.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import build_model
from rayjobs import data as data_lib
from rayjobs.config import RunConfig, from_dict
from rayjobs.parallel import WorkerContext, all_reduce_sum, current_context, unwrap, wrap_data_parallel

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def log(message: str) -> None:
    """Print one progress line (written to stdout directly: Ray Train's print patch would echo it twice)."""
    sys.stdout.write(f"[rayjobs] {message}\n")
    sys.stdout.flush()


def train_fn_per_worker(config: dict[str, Any]) -> None:
    """Train one run on this worker. ``config`` is ``RunConfig.model_dump()`` plus ``_resolved``."""

    # Ray Train logs every report at INFO on each worker; the loop prints its own progress lines.
    try:
        from ray.train.v2._internal.execution import context as train_context  # its logger is named by file

        logging.getLogger(train_context.__file__).setLevel(logging.WARNING)
    except ImportError:
        pass
    resolved = config.pop("_resolved", {})
    cfg = from_dict(config)
    use_gpu = bool(resolved.get("use_gpu", False))
    ctx = current_context(use_gpu)
    if ctx.device.type == "cpu":
        torch.set_num_threads(max(1, int(resolved.get("cpus_per_worker", 1))))
    seed_everything(cfg.training.seed)

    # 1. Data: this rank's shard of the training set; micro-batches sized from the global batch.
    splits = data_lib.load(cfg.data.name, cfg.data.kwargs)
    micro_batch = micro_batch_size(cfg.training.batch_size, ctx.world_size, cfg.training.grad_accum)
    train_loader = data_lib.shard_loader(splits.train, micro_batch, ctx.rank, ctx.world_size, cfg.training.seed)
    steps_per_epoch = len(train_loader) // cfg.training.grad_accum
    if steps_per_epoch == 0:
        raise ValueError(
            f"training.batch_size={cfg.training.batch_size} is larger than the training set "
            f"({len(splits.train)} samples); lower it"  # type: ignore[arg-type]
        )
    total_steps = steps_per_epoch * cfg.training.epochs
    if cfg.training.max_steps:
        total_steps = min(total_steps, cfg.training.max_steps)

    # 2. Model: built the same on every rank, then wrapped for data parallelism from outside.
    model = build_model(cfg.model.name, cfg.model.flavor, cfg.model.kwargs, splits.info).to(ctx.device)
    model = wrap_data_parallel(model, ctx)
    seed_everything(cfg.training.seed + ctx.rank)  # distinct dropout per rank
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    scaler = torch.amp.GradScaler(enabled=cfg.training.precision == "fp16" and ctx.device.type == "cuda")
    if ctx.is_main:
        n_params = sum(p.numel() for p in unwrap(model).parameters())
        log(
            f"{cfg.model.name}/{cfg.model.flavor}: {n_params:,} parameters; "
            f"{ctx.world_size} worker(s) on {ctx.device.type}; micro-batch {micro_batch} x "
            f"accum {cfg.training.grad_accum} x {ctx.world_size} = {cfg.training.batch_size}; {total_steps} steps"
        )

    # 3. Loop: accumulate micro-batches, step, evaluate and report at eval points.
    step, train_time, samples = 0, 0.0, 0
    window: list[float] = []
    metrics: dict[str, float] = {}
    eval_every = cfg.training.eval_every or steps_per_epoch
    for epoch in range(cfg.training.epochs):
        train_loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        batches = iter(train_loader)
        for _ in range(steps_per_epoch):
            if step >= total_steps:
                break
            t0 = time.perf_counter()
            group = [next(batches) for _ in range(cfg.training.grad_accum)]
            loss, grad_norm = train_step(model, group, optimizer, cfg, ctx, scaler)
            scheduler.step()
            step += 1
            train_time += time.perf_counter() - t0
            samples += cfg.training.batch_size
            window.append(loss)
            if ctx.is_main and step % cfg.training.log_every == 0:
                log(
                    f"step {step}/{total_steps} epoch {epoch + 1} loss {loss:.4f} "
                    f"lr {scheduler.get_last_lr()[0]:.2e} {samples / train_time:.0f} samples/s"
                )

            # 4. Eval and report (a barrier on every rank) at each eval point and at the end.
            last = step == total_steps
            if step % eval_every == 0 or last:
                mean_loss = all_reduce_sum([sum(window), len(window)], ctx)
                metrics = {
                    "step": step,
                    "epoch": epoch + 1,
                    "train/loss": mean_loss[0] / max(mean_loss[1], 1),
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/grad_norm": grad_norm,
                    "train/samples_per_s": samples / train_time,
                    **evaluate(model, splits.val, cfg, ctx, prefix="val"),
                }
                window = []
                if last:
                    break
                report(metrics, None, resolved)
        if step >= total_steps:
            break

    # 5. Final: test metrics and a checkpoint of the weights, reported together.
    metrics.update(evaluate(model, splits.test, cfg, ctx, prefix="test"))
    report_final(metrics, model, cfg, ctx, resolved)


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


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over every prediction (a class per image, or a token per position)."""
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()  # the softmax of an autocast run in fp32
    return F.cross_entropy(flat, targets.reshape(-1))


def autocast(cfg: RunConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Mixed-precision autocast for bf16/fp16; nothing for fp32."""
    dtype = PRECISION_DTYPES.get(cfg.training.precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def train_step(
    model: nn.Module,
    micro_batches: Sequence[tuple[Tensor, Tensor]],
    optimizer: torch.optim.Optimizer,
    cfg: RunConfig,
    ctx: WorkerContext,
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[float, float]:
    """One optimizer step over ``grad_accum`` equal micro-batches; returns (mean loss, grad norm).

    Each micro-batch loss is a mean over its samples, divided by the number of micro-batches, so
    the summed gradient equals the gradient of the mean loss over the whole local batch; DDP then
    averages over ranks, giving exactly the gradient of one large global batch. Gradients are
    all-reduced only on the last micro-batch (``no_sync`` before it).
    """
    model.train()
    accum = len(micro_batches)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        sync = i == accum - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync(), autocast(cfg, ctx.device):
            loss = loss_fn(model(x), y) / accum
        (scaler.scale(loss) if scaler is not None and scaler.is_enabled() else loss).backward()
        total += loss.item()
    if scaler is not None and scaler.is_enabled():
        scaler.unscale_(optimizer)
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
    if scaler is not None and scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Any, cfg: RunConfig, ctx: WorkerContext, prefix: str) -> dict[str, float]:
    """Loss and accuracy over ``dataset``: each rank takes a strided share, sums are all-reduced."""
    model.eval()
    loss_sum, correct, count = 0.0, 0.0, 0.0
    for x, y in data_lib.eval_shard(dataset, ctx.rank, ctx.world_size, max(64, cfg.training.batch_size)):
        x, y = x.to(ctx.device), y.to(ctx.device)
        with autocast(cfg, ctx.device):
            logits = model(x)
        flat = logits.reshape(-1, logits.shape[-1]).float()
        loss_sum += F.cross_entropy(flat, y.reshape(-1), reduction="sum").item()
        correct += (flat.argmax(-1) == y.reshape(-1)).sum().item()
        count += y.numel()
    loss_sum, correct, count = all_reduce_sum([loss_sum, correct, count], ctx)
    model.train()
    return {f"{prefix}/loss": loss_sum / max(count, 1), f"{prefix}/accuracy": correct / max(count, 1)}


def build_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW or SGD over the model's parameters, from ``cfg.optim``."""
    o = cfg.optim
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)


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
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))


def report(metrics: dict[str, float], checkpoint: Any, resolved: dict[str, Any]) -> None:
    """``ray.train.report`` on every rank; in local mode also the run's metrics history (no controller there)."""
    import ray.train

    if resolved.get("local_history_path"):
        from rayjobs.train import append_history

        append_history(resolved["local_history_path"], metrics)
    ray.train.report(metrics, checkpoint=checkpoint)


def report_final(
    metrics: dict[str, float], model: nn.Module, cfg: RunConfig, ctx: WorkerContext, resolved: dict[str, Any]
) -> None:
    """Report the final metrics with a checkpoint of the weights (written by rank 0).

    Ray Train copies a reported checkpoint into the run's storage; local mode does not, so there
    the checkpoint is written straight to ``local_dir`` (under the run's storage path).
    """
    import ray.train

    local_dir = resolved.get("local_checkpoint_dir")
    if not ctx.is_main:
        report(metrics, None, resolved)
        return
    if local_dir:
        staging = f"{local_dir}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        write_weights(staging, model, cfg)
        shutil.rmtree(local_dir, ignore_errors=True)
        os.replace(staging, local_dir)
        report(metrics, ray.train.Checkpoint.from_directory(local_dir), resolved)
        return
    with tempfile.TemporaryDirectory(prefix="rayjobs-final-") as d:
        write_weights(d, model, cfg)
        report(metrics, ray.train.Checkpoint.from_directory(d), resolved)


def write_weights(directory: str, model: nn.Module, cfg: RunConfig) -> None:
    """Write the model's state dict (``model.pt``) and the resolved config (``config.yaml``)."""
    from rayjobs.config import to_yaml

    os.makedirs(directory, exist_ok=True)
    torch.save(unwrap(model).state_dict(), os.path.join(directory, "model.pt"))
    with open(os.path.join(directory, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
