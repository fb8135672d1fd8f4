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
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from models import build_model, flops_per_sample
from rayjobs import checkpoint as ckpt
from rayjobs import data as data_lib
from rayjobs import devices, memory, paths, storage, strategies, telemetry
from rayjobs.checkpoint import Saver, TrainState
from rayjobs.config import RunConfig, from_dict, redacted_dump
from rayjobs.errors import ExplainedFailure
from rayjobs.faults import Faults
from rayjobs.object_store import RunStore
from rayjobs.parallel import WorkerContext, all_reduce_sum, current_context
from rayjobs.train import record_event

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def log(message: str) -> None:
    """Print one progress line (written to stdout directly: Ray Train's print patch would echo it twice)."""
    sys.stdout.write(f"[rayjobs] {message}\n")
    sys.stdout.flush()


def train_fn_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Train one run on this worker. ``config`` is ``RunConfig.model_dump()`` plus ``_resolved``.

    Returns (rank 0's value reaches the driver as ``Result.return_value``) how the run ended.
    A failure stops rank 0's MLflow logger first: in local mode the driver's replay shares its spool.
    """
    loggers: list[Any] = []
    try:
        return _train(config, loggers)
    except BaseException:
        for logger in loggers:
            logger.close(timeout=10)
        raise


def _train(config: dict[str, Any], loggers: list[Any]) -> dict[str, Any]:
    quiet_ray_train_logs()
    resolved = config.pop("_resolved", {})
    cfg = from_dict(config)
    paths.require_absolute(cfg)  # resolved on the driver: this process's cwd is Ray's, not the user's
    store = RunStore(cfg.storage_uri, cfg.run.name) if cfg.storage_uri else None  # checkpoints in a bucket
    if resolved.get("storage_mark"):
        storage.check_shared(cfg.run_dir, resolved["storage_mark"], store)
    ctx = current_context(bool(resolved.get("use_gpu", False)))
    if ctx.device.type == "cpu":
        torch.set_num_threads(max(1, int(resolved.get("cpus_per_worker", 1))))
    seed_everything(cfg.training.seed)
    accum = cfg.training.grad_accum
    ctx, layout = strategies.place(cfg, ctx)  # ranks of one model replica share a data shard

    # 1. Data: this rank's shard of the training set; micro-batches sized from the global batch.
    shard, shards = ctx.data_shard
    micro_batch = micro_batch_size(cfg.training.batch_size, shards, accum)
    splits = data_lib.TrainingData(
        cfg.data.name, cfg.data.kwargs, cfg.training.seed, shard, shards, micro_batch, accum, resolved.get("streaming")
    )
    steps_per_epoch = splits.steps_per_epoch
    if steps_per_epoch == 0:
        raise ValueError(f"training.batch_size={cfg.training.batch_size} is larger than the training set; lower it")
    total_steps = steps_per_epoch * cfg.training.epochs
    if cfg.training.max_steps:
        total_steps = min(total_steps, cfg.training.max_steps)
    # A segment of the run (population-based training): stop here, keep the schedule of total_steps.
    stop_at = min(total_steps, int(resolved.get("stop_at_step") or total_steps))

    # 2. Devices alike; the model built the same on every rank, then parallelized from outside.
    found = devices.check_alike(ctx, cfg.parallel.allow_mixed_devices)
    if ctx.is_main:
        memory.warn_if_too_big(resolved.get("memory_estimate_bytes"), found[0], cfg)
    model = build_model(cfg.model.name, cfg.model.flavor, cfg.model.kwargs, splits.info).to(ctx.device)
    n_params = sum(p.numel() for p in model.parameters())
    flops = flops_per_sample(cfg.model.name, model, splits.info)  # before a pipeline stage drops parts
    peak, peak_source = telemetry.device_peak(ctx.device, cfg.training.precision)
    job_peak = peak * ctx.world_size
    parallel = strategies.apply(model, cfg, ctx, layout, loss_fn)
    model, pipeline = parallel.model, parallel.pipeline
    seed_everything(cfg.training.seed + ctx.rank)  # distinct dropout per rank
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    scaler = torch.amp.GradScaler(enabled=cfg.training.precision == "fp16" and ctx.device.type == "cuda")

    # 3. Resume from the newest complete checkpoint (restart, re-run) or checkpoint.resume_from.
    faults = Faults(cfg.faults, cfg.run_dir, ctx)
    state, resumed_from = resume(
        cfg, ctx, model, optimizer, scheduler, scaler, faults, store, bool(resolved.get("exploit"))
    )
    saver = Saver(
        cfg.run_dir,
        ctx,
        redacted_dump(cfg),
        cfg.checkpoint.keep_last,
        cfg.checkpoint.keep_best,
        cfg.checkpoint.metric,
        cfg.checkpoint.mode,
        cfg.checkpoint.async_save,
        store,
        protect=cfg.checkpoint.resume_from,
        same_buffers=layout.pp == 1,
    )
    preemption = Preemption(local_mode=bool(resolved.get("local_mode")))
    if ctx.is_main:
        log(
            f"{cfg.model.name}/{cfg.model.flavor}: {n_params:,} parameters; {ctx.world_size} worker(s) on "
            f"{ctx.device.type} ({layout.describe()}); micro-batch {micro_batch} x accum {accum} x {shards} = "
            f"{cfg.training.batch_size}; {total_steps} steps" + (f"; from step {state.step}" if resumed_from else "")
        )
        log(f"MFU against {peak / 1e12:.3g} TFLOP/s per worker ({peak_source}); {flops / 1e9:.3g} GFLOP per sample")

    mlflow_log = start_metrics_logger(cfg, ctx, resolved)
    loggers += [mlflow_log] if mlflow_log is not None else []
    tokens_per_sample = splits.info.input_shape[0] if splits.info.kind == "tokens" else 0

    # 4. Loop: accumulate micro-batches, step, evaluate/checkpoint/report at their boundaries.
    train_time, saved_at_step = 0.0, state.step if resumed_from else -1
    first_step, loop_started = state.step + 1, time.perf_counter()
    while state.step < stop_at:
        if state.step_in_epoch >= steps_per_epoch:
            state.epoch, state.step_in_epoch = state.epoch + 1, 0
            continue
        batches, end_of_epoch = splits.epoch(state.epoch, state.step_in_epoch), False
        while state.step < stop_at and state.step_in_epoch < steps_per_epoch and not end_of_epoch:
            t0 = time.perf_counter()
            faults.before_step(state.step + 1)
            group = [next(batches) for _ in range(accum)]
            data_wait = time.perf_counter() - t0
            state.data_wait_s += data_wait
            try:
                faults.oom_now(state.step + 1)
                result = train_step(model, group, optimizer, cfg, ctx, scaler, faults.nan_now(state.step + 1), pipeline)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if not memory.is_oom(exc):
                    raise
                raise memory.OutOfMemory(memory.oom_message(exc, ctx, state.step + 1, cfg, layout)) from None
            if not result.finite and cfg.training.nan_policy == "stop":
                return stop_on_nan(state.step + 1, result.bad_ranks, saver, ctx, resolved)
            scheduler.step()
            state.step, state.step_in_epoch = state.step + 1, state.step_in_epoch + 1
            state.samples += cfg.training.batch_size
            if result.finite:
                state.loss_sum, state.loss_count = state.loss_sum + result.loss, state.loss_count + 1
            elif ctx.is_main:
                log(f"step {state.step}: non-finite loss on rank(s) {result.bad_ranks}; step skipped (nan_policy=skip)")
            step_time = time.perf_counter() - t0
            if ctx.is_main and state.step == first_step:
                record_event(cfg.run_dir, "first_step", step=state.step)
            step_metrics = per_step_metrics(
                cfg, state.step, result, scheduler, step_time, tokens_per_sample, flops / job_peak
            )
            if step_metrics:
                step_metrics["perf/data_wait_fraction"] = data_wait / step_time
            if mlflow_log is not None and step_metrics:
                mlflow_log.log(step_metrics, state.step)
            train_time += time.perf_counter() - t0  # logging counts against throughput
            if ctx.is_main and state.step % cfg.training.log_every == 0:
                log(
                    f"step {state.step}/{total_steps} epoch {state.epoch + 1} loss {result.loss:.4f} "
                    f"lr {scheduler.get_last_lr()[0]:.2e} {state.samples / max(train_time, 1e-9):.0f} samples/s "
                    f"MFU {100 * flops * state.samples / max(train_time, 1e-9) / job_peak:.1f}% "
                    f"{progress_times(time.perf_counter() - loop_started, state.step - first_step + 1, stop_at - state.step)}"
                )

            # 5. Boundaries: eval, checkpoint (also on preemption), report: the same on every rank.
            end_of_epoch = state.step_in_epoch == steps_per_epoch
            if end_of_epoch:
                state.epoch, state.step_in_epoch = state.epoch + 1, 0
                splits.finish_epoch(batches)
            if state.step == stop_at:
                break  # the final eval, checkpoint and report follow the loop
            do_eval = (state.step % cfg.training.eval_every == 0) if cfg.training.eval_every else end_of_epoch
            preempted = preemption.requested(ctx, state.step)  # the process may end right after: save synchronously
            do_save = checkpoint_due(cfg, state.step, state.epoch, end_of_epoch) or preempted
            if do_eval:
                state.metrics = summarize(
                    state, scheduler, result.grad_norm, train_time, ctx, model, splits.val, cfg, pipeline
                )
                state.metrics["perf/mfu"] = flops * state.metrics["train/samples_per_s"] / job_peak
                if mlflow_log is not None:
                    mlflow_log.log(state.metrics, state.step)
            if do_save:
                path = saver.save(state.step, model, optimizer, scheduler, scaler, state, force_sync=preempted)
                saved_at_step = state.step
            if do_eval or do_save:  # a checkpoint-only report carries no stale eval metrics
                shown = state.metrics if do_eval else {"step": state.step, "epoch": state.epoch}
                report(shown, path if do_save else None, resolved, store)
            preemption.exit_if_requested(ctx)

    # 6. Final: test metrics, a checkpoint of the final state (always), one last report.
    saver.wait()
    state.metrics = summarize(
        state, scheduler, state.metrics.get("train/grad_norm", 0.0), train_time, ctx, model, splits.val, cfg, pipeline
    )
    if splits.test is not None:
        state.metrics.update(evaluate(model, splits.test, cfg, ctx, prefix="test", pipeline=pipeline))
    state.metrics["perf/mfu"] = flops * state.metrics["train/samples_per_s"] / job_peak
    if saved_at_step == state.step and resumed_from and state.step == resumed_from[1]:
        final = resumed_from[0]  # nothing trained since: that checkpoint is the final state
    else:
        final = saver.save(state.step, model, optimizer, scheduler, scaler, state, force_sync=True)
    state.metrics["checkpoint/blocked_s"] = sum(saver.blocked_s) / max(1, len(saver.blocked_s))
    if mlflow_log is not None:
        mlflow_log.log(state.metrics, state.step)
        if not mlflow_log.close(timeout=30):
            log(f"MLflow unreachable at the end: metrics stay spooled in {mlflow_log.spool}; the driver retries")
    report(state.metrics, final, resolved, store)
    return {"stopped": "done", "step": state.step}


def progress_times(elapsed_s: float, steps_done: int, steps_left: int) -> str:
    """``elapsed 1m05s eta 40s``: this attempt's time so far and the rest at its mean pace (evals included)."""
    eta = elapsed_s / max(steps_done, 1) * steps_left
    return f"elapsed {format_duration(elapsed_s)} eta {format_duration(eta)}"


def format_duration(seconds: float) -> str:
    """``42s``, ``3m07s``, ``1h02m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def quiet_ray_train_logs() -> None:
    """Ray Train logs every report at INFO on each worker; the loop prints its own progress lines."""
    try:
        from ray.train.v2._internal.execution import context as train_context  # its logger is named by file

        logging.getLogger(train_context.__file__).setLevel(logging.WARNING)
    except ImportError:
        pass


def checkpoint_due(cfg: RunConfig, step: int, epoch: int, end_of_epoch: bool) -> bool:
    """Whether ``checkpoint.every_steps`` or ``checkpoint.every_epochs`` asks for a save now."""
    c = cfg.checkpoint
    return bool(
        (c.every_steps and step % c.every_steps == 0)
        or (c.every_epochs and end_of_epoch and epoch % c.every_epochs == 0)
    )


def summarize(
    state: TrainState,
    scheduler: Any,
    grad_norm: float,
    train_time: float,
    ctx: WorkerContext,
    model: nn.Module,
    val: Any,
    cfg: RunConfig,
    pipeline: strategies.Pipeline | None = None,
) -> dict[str, float]:
    """The metrics of a report: the train-loss mean since the last report (then reset), LR, eval."""
    loss_sum, count = all_reduce_sum([state.loss_sum, state.loss_count], ctx)
    state.loss_sum, state.loss_count = 0.0, 0
    return {
        "step": state.step,
        "epoch": state.epoch,
        "train/loss": loss_sum / max(count, 1),
        "train/lr": scheduler.get_last_lr()[0],
        "train/grad_norm": grad_norm,
        "train/samples_per_s": state.samples / max(train_time, 1e-9),
        "perf/data_wait_fraction": state.data_wait_s / max(train_time, 1e-9),
        **evaluate(model, val, cfg, ctx, prefix="val", pipeline=pipeline),
        **memory_metrics(ctx),
    }


def per_step_metrics(
    cfg: RunConfig,
    step: int,
    result: StepResult,
    scheduler: Any,
    step_time: float,
    tokens_per_sample: int,
    mfu_per_sample: float = 0.0,
) -> dict[str, float]:
    """What MLflow gets every ``tracking.log_every`` steps (nothing on the other steps)."""
    if step % cfg.tracking.log_every:
        return {}
    out = {
        "train/step_loss": result.loss,
        "train/lr": scheduler.get_last_lr()[0],
        "train/grad_norm": result.grad_norm,
        "perf/step_time_s": step_time,
        "perf/samples_per_s": cfg.training.batch_size / step_time,
    }
    if mfu_per_sample:  # model FLOPs per sample over the job's peak FLOP/s
        out["perf/mfu"] = mfu_per_sample * cfg.training.batch_size / step_time
    if tokens_per_sample:
        out["perf/tokens_per_s"] = cfg.training.batch_size * tokens_per_sample / step_time
    return out


def memory_metrics(ctx: WorkerContext) -> dict[str, float]:
    """Every rank's peak memory (CPU RSS; GPU allocated and reserved), gathered on all ranks."""
    import psutil

    gib = 2**30
    mine = [psutil.Process().memory_info().rss / gib, 0.0, 0.0]
    if ctx.device.type == "cuda":
        mine[1] = torch.cuda.max_memory_allocated(ctx.device) / gib
        mine[2] = torch.cuda.max_memory_reserved(ctx.device) / gib
    table = [0.0] * (3 * ctx.world_size)
    table[3 * ctx.rank : 3 * ctx.rank + 3] = mine
    table = all_reduce_sum(table, ctx)
    out = {}
    for r in range(ctx.world_size):
        out[f"memory/rank{r}/cpu_rss_gib"] = table[3 * r]
        if ctx.device.type == "cuda":
            out[f"memory/rank{r}/gpu_peak_allocated_gib"] = table[3 * r + 1]
            out[f"memory/rank{r}/gpu_peak_reserved_gib"] = table[3 * r + 2]
    return out


def start_metrics_logger(cfg: RunConfig, ctx: WorkerContext, resolved: dict[str, Any]) -> Any:
    """Rank 0's MLflow logger for the run the driver made (None on other ranks or without tracking)."""
    info = resolved.get("mlflow")
    if not ctx.is_main or not cfg.tracking.enabled or not info:
        return None
    from rayjobs.tracking import MetricsLogger, next_attempt

    return MetricsLogger(cfg, info.get("run_id"), info["run_key"], info["spool"], attempt=next_attempt(cfg.run_dir))


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
            choice = [other_model(choice[0], cfg) or choice[0]]
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


def other_model(path: str, cfg: RunConfig) -> str:
    """'error: ...' when the checkpoint at ``path`` holds another model, or was trained on other data,
    than ``cfg``'s run; else ''."""
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
        group["weight_decay"] = cfg.optim.weight_decay
        if "momentum" in group:
            group["momentum"] = cfg.optim.momentum
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    if ctx.is_main:
        log(
            "optimizer settings changed on resume: "
            + ", ".join(f"optim.{k} {a} -> {b}" for k, (a, b) in changed.items())
        )


def stop_on_nan(
    step: int, bad_ranks: list[int], saver: Saver, ctx: WorkerContext, resolved: dict[str, Any]
) -> dict[str, Any]:
    """Every rank stops at the same step; the driver turns this report into a clear failure."""
    saver.wait()
    if ctx.is_main:
        log(f"step {step}: non-finite loss on rank(s) {bad_ranks}; every rank stops here (training.nan_policy=stop)")
    report({"step": step, "nan/stop_step": step}, None, resolved)
    return {"stopped": "nan", "step": step, "ranks": bad_ranks}


class Preemption:
    """Notice of an imminent preemption: Ray's (a node being drained) or, in local mode, SIGTERM."""

    CHECK_EVERY = 10  # steps between Ray's preemption checks (each is a barrier across workers)

    def __init__(self, local_mode: bool) -> None:
        self.local_mode = local_mode
        self.sigterm = False
        self.saved = False
        if local_mode and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.sigterm = True

    def requested(self, ctx: WorkerContext, step: int) -> bool:
        """True once when a checkpoint should be taken now because of a preemption."""
        if self.saved:
            return False
        if self.local_mode:
            notice = self.sigterm
        elif step % self.CHECK_EVERY == 0:
            import ray.train

            notice = ray.train.get_preemption_info() is not None
        else:
            notice = False
        if notice:
            self.saved = True
            if ctx.is_main:
                log(f"step {step}: preemption notice: taking a checkpoint now")
        return notice

    def exit_if_requested(self, ctx: WorkerContext) -> None:
        """After the SIGTERM checkpoint (local mode), end the process the way SIGTERM would have."""
        if self.sigterm and self.saved:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


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


@dataclass
class StepResult:
    """What one optimizer step produced; ``finite`` is agreed across ranks."""

    loss: float
    grad_norm: float
    finite: bool = True
    bad_ranks: list[int] = field(default_factory=list)


def train_step(
    model: nn.Module,
    micro_batches: Sequence[tuple[Tensor, Tensor]],
    optimizer: torch.optim.Optimizer,
    cfg: RunConfig,
    ctx: WorkerContext,
    scaler: torch.amp.GradScaler | None = None,
    inject_nan: bool = False,
    pipeline: strategies.Pipeline | None = None,
) -> StepResult:
    """One optimizer step over ``grad_accum`` equal micro-batches.

    Each micro-batch loss is a mean over its samples, divided by the number of micro-batches, so
    the summed gradient equals the gradient of the mean loss over the whole local batch; DDP then
    averages over ranks, giving exactly the gradient of one large global batch. Gradients are
    all-reduced only on the last micro-batch (``no_sync`` before it). A non-finite loss on any
    rank is agreed on by all ranks (an all-reduce of the flags); the step is then not taken. The
    loss returned is the mean over the data-parallel replicas. With a pipeline, the micro-batches
    form one batch that the schedule splits into ``parallel.microbatches`` itself.
    """
    model.train()
    scaling = scaler is not None and scaler.is_enabled()
    if pipeline is not None:
        total = pipeline_forward_backward(micro_batches, pipeline, ctx)
    else:
        total = 0.0
        accum = len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            with gradient_sync(model, i == accum - 1), autocast(cfg, ctx.device):
                loss = loss_fn(model(x), y) / accum
                if inject_nan and i == accum - 1:
                    loss = loss * float("nan")
            (scaler.scale(loss) if scaling else loss).backward()
            total += loss.item()
    total, bad_ranks = agree_on_loss(total, ctx)
    if bad_ranks:
        optimizer.zero_grad(set_to_none=True)
        return StepResult(total, float("nan"), finite=False, bad_ranks=bad_ranks)
    if scaling:
        scaler.unscale_(optimizer)
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm = strategies.clip_grad_norm(model, clip, pipeline)
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


def pipeline_forward_backward(
    micro_batches: Sequence[tuple[Tensor, Tensor]], pipeline: strategies.Pipeline, ctx: WorkerContext
) -> float:
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


def pipeline_forward(x: Tensor, y: Tensor, batch: int, pipeline: strategies.Pipeline) -> Tensor | None:
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


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Any,
    cfg: RunConfig,
    ctx: WorkerContext,
    prefix: str,
    pipeline: strategies.Pipeline | None = None,
) -> dict[str, float]:
    """Loss and accuracy over ``dataset``: each replica takes a strided share, one rank per replica
    counts it, and the sums are all-reduced."""
    model.eval()
    loss_sum, correct, count = 0.0, 0.0, 0.0
    shard, shards = ctx.data_shard
    # A pipeline's stages were shaped for the training batch: evaluate in batches of that size.
    batch = cfg.training.batch_size // shards if pipeline else max(64, cfg.training.batch_size)
    for x, y in data_lib.eval_batches(dataset, shard, shards, batch):
        x, y = x.to(ctx.device), y.to(ctx.device)
        if pipeline is not None:
            logits = pipeline_forward(x, y, batch, pipeline)
        else:
            with autocast(cfg, ctx.device):
                logits = model(x)
        if logits is None or not ctx.counts_metrics:
            continue
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
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))
    scheduler.total_steps = total_steps  # type: ignore[attr-defined]
    return scheduler


def report(
    metrics: dict[str, Any], checkpoint_path: str | None, resolved: dict[str, Any], store: RunStore | None = None
) -> None:
    """``ray.train.report`` on every rank (a barrier); rank 0 names the committed checkpoint.

    Checkpoints are written straight into the run's storage by DCP, so Ray Train only records
    them (``NO_UPLOAD``). In local mode (no controller) the metrics history is written here.
    """
    import ray.train
    from ray.train import CheckpointUploadMode

    if resolved.get("local_history_path"):
        from rayjobs.train import append_history

        append_history(resolved["local_history_path"], metrics)
    checkpoint = ray.train.Checkpoint(checkpoint_path) if checkpoint_path else None
    if checkpoint is not None and store is not None and not resolved.get("local_mode"):
        # Uploaded already (Saver): Ray records its place in the bucket, on the filesystem Ray was given.
        fs = ray.train.get_context().get_storage().storage_filesystem
        checkpoint = ray.train.Checkpoint(store.path(os.path.basename(checkpoint_path)), filesystem=fs)
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
