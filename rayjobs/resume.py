"""Resume: which checkpoint a start goes on from (rank 0 chooses, every rank loads), and what changed since.

A restart, an elastic resize or the same command again resumes from the run's own newest
complete checkpoint; ``checkpoint.resume_from`` is for the run's first start; a PBT exploit
replaces the trial's state on purpose. A checkpoint of another model, dataset or lineage is
refused in one line.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rayjobs import checkpoint as ckpt
from rayjobs.checkpoint import TrainState
from rayjobs.config import RunConfig
from rayjobs.context import WorkerContext
from rayjobs.errors import ExplainedFailure
from rayjobs.faults import Faults
from rayjobs.log import log
from rayjobs.stepping import lr_factor
from rayjobs.storage.bucket import RunStore


def resume(
    cfg: RunConfig,
    ctx: WorkerContext,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
    faults: Faults,
    store: RunStore | None = None,
    exploit: bool = False,
) -> tuple[TrainState, tuple[str, int] | None]:
    """Load the checkpoint to resume from, if any; rank 0 chooses (and verifies) it for every rank.

    ``checkpoint.resume_from`` is for the run's first start: once the run has checkpoints of its own
    (written after resuming from it), every later start resumes from its own newest. A PBT exploit
    (``exploit``) is the exception: it replaces the trial's state with the donor's on purpose.
    With an object store the newest complete checkpoint in the bucket is downloaded first.
    """
    choice: list[Any] = [None]
    from_bucket = store is not None and not cfg.checkpoint.resume_from
    if from_bucket:  # every rank takes part; each gets the same local copy's path
        choice = [ckpt.fetch_latest(store, cfg.run_dir, ctx)]
    elif ctx.is_main:
        faults.corrupt_latest(cfg.run_dir)
        source = cfg.checkpoint.resume_from
        own = ckpt.latest_complete(cfg.run_dir) if source and not exploit else None
        if own is not None and os.path.abspath(own.path) != os.path.abspath(source):
            # A later start of this run (a restart, an elastic resize, the same command again) goes on
            # from its own newest checkpoint; checkpoints of another lineage are not this run's.
            lineage = ckpt.saved_config(own.path).get("checkpoint", {}).get("resume_from", "")
            choice = [
                own.path
                if lineage == source
                else f"error: checkpoint.resume_from: {cfg.run_dir} already holds checkpoints of another run "
                f"(newest: step {own.step}); give this run a new run.name, or remove that directory"
            ]
        elif source:
            problem = ckpt.verify(source)
            choice = [f"error: --resume-from {source}: {problem}" if problem else source]
        else:
            info = ckpt.latest_complete(cfg.run_dir)
            choice = [info.path if info else None]
            if info is None and ckpt.list_checkpoints(cfg.run_dir, check=False):
                log(f"no complete checkpoint in {cfg.run_dir}: starting from step 0")
        if choice[0] and not choice[0].startswith("error: "):
            choice = [incompatible_checkpoint(choice[0], cfg) or choice[0]]
    if ctx.world_size > 1 and dist.is_initialized() and not from_bucket:
        dist.broadcast_object_list(choice, src=0)
    path = choice[0]
    if path is None:
        return TrainState(), None
    if path.startswith("error: "):
        raise ResumeRefused(path.removeprefix("error: "))
    saved = ckpt.load(path, model, optimizer, ctx, scheduler, scaler)
    state = TrainState(**saved["train"])
    apply_new_optim_settings(
        saved["config"].get("optim", {}), cfg, optimizer, scheduler, state.step, total_steps_of(scheduler), ctx
    )
    if ctx.is_main:
        log(f"resumed from {path} at step {state.step} (epoch {state.epoch + 1}, step {state.step_in_epoch} of it)")
        if saved["world_size"] != ctx.world_size:
            log(
                f"the checkpoint was written by {saved['world_size']} worker(s), this run has {ctx.world_size}: "
                f"DCP resharded the model and optimizer; the global batch stays {cfg.training.batch_size} "
                f"and the data order is the same; dropout RNG streams restart from the seed"
            )
    return state, (path, state.step)


class ResumeRefused(ExplainedFailure):
    """The checkpoint this start would resume from is not this run's (another model or lineage)."""


def incompatible_checkpoint(path: str, cfg: RunConfig) -> str:
    """'error: ...' when the checkpoint at ``path`` holds another model, or was trained on other data
    or with another optimizer, than ``cfg``'s run; else ''."""
    saved = ckpt.saved_config(path)
    model, data = saved.get("model") or {}, saved.get("data") or {}
    theirs = (model.get("name"), model.get("flavor"), model.get("kwargs") or {})
    ours = (cfg.model.name, cfg.model.flavor, cfg.model.kwargs)
    shown = lambda m: f"{m[0]}/{m[1] or '-'}" + (f" {m[2]}" if m[2] else "")  # noqa: E731
    fix = "give this run its own run.name (--set run.name=...), or resume a checkpoint of the same job"
    if model and theirs != ours:
        return f"error: {path} holds a checkpoint of the model {shown(theirs)}, but this run's model is {shown(ours)}; {fix}"
    if data and data.get("name") != cfg.data.name:
        return f"error: {path} was trained on data.name={data.get('name')}, this run reads data.name={cfg.data.name}; {fix}"
    optimizer = (saved.get("optim") or {}).get("name")
    if optimizer and optimizer != cfg.optim.name:
        return (
            f"error: {path} was trained with optim.name={optimizer}, this run uses optim.name={cfg.optim.name} "
            f"(its state cannot carry over); {fix}"
        )
    return ""


def total_steps_of(scheduler: Any) -> int:
    """The total step count the schedule was built for (kept on the scheduler by build_scheduler)."""
    return getattr(scheduler, "total_steps", 0)


def apply_new_optim_settings(
    saved: dict[str, Any],
    cfg: RunConfig,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    step: int,
    total_steps: int,
    ctx: WorkerContext,
) -> None:
    """A resumed run whose config changed lr/weight_decay/momentum (e.g. a PBT exploit) uses the new values."""
    changed = {
        k: (saved.get(k), getattr(cfg.optim, k))
        for k in ("lr", "weight_decay", "momentum")
        if k in saved and saved.get(k) != getattr(cfg.optim, k)
    }
    if not changed:
        return
    scheduler.base_lrs = [cfg.optim.lr for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = cfg.optim.lr * lr_factor(step, cfg, total_steps)
        group["weight_decay"] = 0.0 if group.get("no_decay") else cfg.optim.weight_decay
        if "momentum" in group:
            group["momentum"] = cfg.optim.momentum
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    if ctx.is_main:
        log(
            "optimizer settings changed on resume: "
            + ", ".join(f"optim.{k} {a} -> {b}" for k, (a, b) in changed.items())
        )
