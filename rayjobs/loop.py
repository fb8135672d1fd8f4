"""The worker recipe: ``setup()`` builds a Run, ``train()`` fits it, in numbered steps.

``train_fn_per_worker`` runs on every Ray Train worker (and in local mode in the driver). It
rebuilds the driver's ``LaunchPlan``, then:

    0. place       the config, this rank's device and its place in the parallel layout
    1. data        this rank's shard; micro-batches sized from the global batch
    2. model       built the same on every rank, then parallelized from outside (rayjobs.parallel)
    3. resume      the newest complete checkpoint of this run (or checkpoint.resume_from)
    4. loop        accumulate micro-batches, step (rayjobs.step)
    5. boundaries  eval, checkpoint (also on preemption), report: the same on every rank
    6. final       test metrics, a checkpoint of the final state, one last report
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from models import build_model, flops_per_sample
from rayjobs import data as data_lib
from rayjobs import devices, memory, parallel, paths, storage, tasks, telemetry, timeline
from rayjobs.checkpoint import Saver, TrainState, load_weights
from rayjobs.config import RunConfig, from_dict, redacted_dump
from rayjobs.context import WorkerContext, all_reduce_sum, current_context
from rayjobs.faults import Faults
from rayjobs.log import log
from rayjobs.plan import LaunchPlan
from rayjobs.preemption import Preemption
from rayjobs.resume import resume
from rayjobs.rundir import RunDir
from rayjobs.stepping import (
    LossWindow,
    StepResult,
    build_optimizer,
    build_scheduler,
    evaluate,
    micro_batch_size,
    seed_everything,
    train_step,
)
from rayjobs.storage.bucket import RunStore

LEAN_WINDOW = 100  # the most steps the lean loop runs between checks of its losses


@dataclass
class Run:
    """Everything one rank trains with: built by ``setup``, advanced by ``train``."""

    cfg: RunConfig
    plan: LaunchPlan
    ctx: WorkerContext
    layout: parallel.Layout
    data: data_lib.TrainingData
    model: torch.nn.Module
    pipeline: parallel.Pipeline | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    faults: Faults
    saver: Saver
    state: TrainState
    resumed_from: tuple[str, int] | None
    meter: telemetry.Meter
    store: RunStore | None
    rundir: RunDir
    total_steps: int
    stop_at: int  # a PBT segment stops before total_steps; the schedule keeps total_steps
    preemption: Preemption
    task: tasks.Task
    mlflow: Any = None  # rank 0's MetricsLogger (None elsewhere, or without tracking)
    saved_at_step: int = -1
    loggers: list[Any] = field(default_factory=list)
    early_stopped: dict[str, float] = field(default_factory=dict)  # early_stop/step and /best once it stopped
    launch_marks: dict[str, float] = field(default_factory=dict)  # rayjobs.timeline: the driver's, then this rank's
    window: LossWindow | None = None  # the lean loop's unchecked losses (None: every step is checked)


def train_fn_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Train one run on this worker. ``config`` is ``LaunchPlan.to_dict()``.

    Returns (rank 0's value reaches the driver as ``Result.return_value``) how the run ended.
    A failure stops rank 0's MLflow logger first: in local mode the driver's replay shares its spool.
    """
    run, entered = None, time.time()
    try:
        run = setup(LaunchPlan.from_dict(config))
        run.launch_marks.update(worker_start=timeline.process_start(), worker_entered=entered)
        return train(run)
    except BaseException:
        if run is not None and run.mlflow is not None:
            run.mlflow.close(timeout=10)
        raise


def setup(plan: LaunchPlan) -> Run:
    """Steps 0-3: place this rank, shard the data, build and parallelize the model, resume."""
    quiet_ray_train_logs()
    # 0. Place: the config (paths were made absolute on the driver), device, layout.
    cfg = from_dict(plan.config)
    paths.require_absolute(cfg)  # this process's cwd is Ray's, not the user's
    store = RunStore(cfg.storage_uri, cfg.run.name) if cfg.storage_uri else None  # checkpoints in a bucket
    if plan.storage_mark:
        storage.check_shared(cfg.run_dir, plan.storage_mark, store)
    ctx = current_context(plan.use_gpu)
    if ctx.device.type == "cpu":
        torch.set_num_threads(max(1, int(plan.cpus_per_worker)))
    seed_everything(cfg.training.seed)
    ctx, layout = parallel.place(cfg, ctx)  # ranks of one model replica share a data shard

    # 1. Data: this rank's shard of the training set; micro-batches sized from the global batch.
    shard, shards = ctx.data_shard
    micro_batch = micro_batch_size(cfg.training.batch_size, shards, cfg.training.grad_accum)
    t = cfg.training
    data = data_lib.TrainingData(
        cfg.data.name, cfg.data.kwargs, t.seed, shard, shards, micro_batch, t.grad_accum, plan.stream
    )
    data_ready = time.time()
    if data.steps_per_epoch == 0:
        raise ValueError(f"training.batch_size={t.batch_size} is larger than the training set; lower it")
    total_steps = min(data.steps_per_epoch * t.epochs, t.max_steps or data.steps_per_epoch * t.epochs)

    # 2. Devices alike; the model built the same on every rank, then parallelized from outside.
    found = devices.check_alike(ctx, cfg.parallel.allow_mixed_devices)
    if ctx.is_main:
        memory.warn_if_too_big(plan.memory_estimate_bytes, found[0], cfg)
    model = build_model(cfg.model.name, cfg.model.flavor, cfg.model.kwargs, data.info).to(ctx.device)
    n_params = sum(p.numel() for p in model.parameters())
    flops = flops_per_sample(cfg.model.name, model, data.info)  # before a pipeline stage drops parts
    peak, peak_source = telemetry.device_peak(ctx.device, t.precision)
    task = tasks.build_task(cfg.task.name, cfg.task.kwargs)
    parallelized = parallel.apply(model, cfg, ctx, layout, task.loss)
    model = parallelized.model
    seed_everything(t.seed + ctx.rank)  # distinct dropout per rank
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    scaler = torch.amp.GradScaler(enabled=t.precision == "fp16" and ctx.device.type == "cuda")

    # 3. Resume from the newest complete checkpoint (restart, re-run) or checkpoint.resume_from.
    faults = Faults(cfg.faults, cfg.run_dir, ctx)
    state, resumed_from = resume(cfg, ctx, model, optimizer, scheduler, scaler, faults, store, plan.exploit)
    if ctx.is_main:
        log(
            f"{cfg.model.name}/{cfg.model.flavor}: {n_params:,} parameters; {ctx.world_size} worker(s) on "
            f"{ctx.device.type} ({layout.describe()}); micro-batch {micro_batch} x accum {t.grad_accum} x {shards} = "
            f"{t.batch_size}; {total_steps} steps" + (f"; from step {state.step}" if resumed_from else "")
        )
        log(f"MFU against {peak / 1e12:.3g} TFLOP/s per worker ({peak_source}); {flops / 1e9:.3g} GFLOP per sample")
    tokens = data.info.input_shape[0] if data.info.kind == "tokens" else 0
    meter = telemetry.Meter(flops, peak * ctx.world_size, t.batch_size, tokens, cfg.tracking.log_every, state.step + 1)
    run = Run(
        cfg, plan, ctx, layout, data, model, parallelized.pipeline, optimizer, scheduler, scaler, faults,
        new_saver(cfg, ctx, layout, store), state, resumed_from, meter, store, RunDir(cfg.run_dir), total_steps,
        min(total_steps, int(plan.stop_at_step or total_steps)), Preemption(local_mode=plan.local_mode), task,
        saved_at_step=state.step if resumed_from else -1,
        launch_marks={**plan.launch_marks, "data_ready": data_ready, "model_ready": time.time()},
    )  # fmt: skip
    if cfg.training.nan_policy == "stop":  # skip must know before each optimizer step: no window then
        run.window = LossWindow()  # train_step still checks every step under fp16 scaling or a pipeline
    if resumed_from is None and plan.init_from:  # a warm start: weights only, at step 0
        warm_start(run)
    run.mlflow = start_metrics_logger(run)
    return run


def warm_start(run: Run) -> None:
    """Load ``model.init_from``'s weights (the optimizer stays fresh) and evaluate them before step 1."""
    saved = load_weights(run.plan.init_from, run.model, run.ctx)
    metrics = evaluate(run.model, run.data.val, run.cfg, run.ctx, "val", run.pipeline, run.task)
    if run.ctx.is_main:
        shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        log(f"warm start from {run.cfg.model.init_from} (step {saved.get('step')} of its run): {shown} at step 0")
        run.rundir.record_event("warm_start", source=run.cfg.model.init_from, checkpoint=run.plan.init_from, **metrics)


def train(run: Run) -> dict[str, Any]:
    """Steps 4-6: train to ``stop_at``, with evals, checkpoints and reports at the boundaries."""
    state, cfg, steps_per_epoch = run.state, run.cfg, run.data.steps_per_epoch
    while state.step < run.stop_at:
        if state.step_in_epoch >= steps_per_epoch:
            state.epoch, state.step_in_epoch = state.epoch + 1, 0
            continue
        batches, end_of_epoch = run.data.epoch(state.epoch, state.step_in_epoch), False
        while state.step < run.stop_at and state.step_in_epoch < steps_per_epoch and not end_of_epoch:
            # 4. One optimizer step over grad_accum micro-batches.
            result = one_step(run, batches)
            if not result.finite and cfg.training.nan_policy == "stop":
                return stop_on_nan(run, result)
            end_of_epoch = state.step_in_epoch == steps_per_epoch
            if end_of_epoch:
                state.epoch, state.step_in_epoch = state.epoch + 1, 0
                run.data.finish_epoch(batches)
            if state.step == run.stop_at:
                break  # the final eval, checkpoint and report follow the loop
            # 5. Boundaries: eval, checkpoint (also on preemption), report.
            result = at_boundaries(run, result, end_of_epoch)
            if not result.finite and cfg.training.nan_policy == "stop":
                return stop_on_nan(run, result)
    # 6. Final: test metrics, a checkpoint of the final state (always), one last report.
    result = settle(run, StepResult(0.0, 0.0))
    if not result.finite:
        return stop_on_nan(run, result)
    return finish(run)


def one_step(run: Run, batches: Any) -> StepResult:
    """Wait for ``grad_accum`` micro-batches, take one optimizer step, count and log it."""
    state, cfg, ctx, meter = run.state, run.cfg, run.ctx, run.meter
    meter.step_started()
    run.faults.before_step(state.step + 1)
    group = [next(batches) for _ in range(cfg.training.grad_accum)]
    data_wait = meter.since_step_start()
    state.data_wait_s += data_wait
    try:
        run.faults.oom_now(state.step + 1)
        nan = run.faults.nan_now(state.step + 1)
        result = train_step(
            run.model, group, run.optimizer, cfg, ctx, run.scaler, nan, run.pipeline, run.task, run.window is not None
        )
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not memory.is_oom(exc):
            raise
        raise memory.OutOfMemory(memory.oom_message(exc, ctx, state.step + 1, cfg, run.layout)) from None
    if not result.finite and cfg.training.nan_policy == "stop":
        return result
    run.scheduler.step()
    state.step, state.step_in_epoch = state.step + 1, state.step_in_epoch + 1
    state.samples += cfg.training.batch_size
    if result.pending is not None:  # the lean loop: its losses are checked every few steps
        run.window.add(state.step, result)
        result = settle(run, result) if check_due(run) else result
        if not result.finite:
            return result
    elif result.finite:
        state.loss_sum, state.loss_count = state.loss_sum + result.loss, state.loss_count + 1
    elif ctx.is_main:
        log(f"step {state.step}: non-finite loss on rank(s) {result.bad_ranks}; step skipped (nan_policy=skip)")
    if ctx.is_main and state.step == meter.first_step:
        run.rundir.record_event("first_step", step=state.step)
        report_launch(run)
    if result.pending is not None:  # not checked yet: nothing of it to log
        meter.step_done()
        return result
    lr = run.scheduler.get_last_lr()[0]
    step_metrics = meter.step_metrics(state.step, result.loss, lr, result.grad_norm, data_wait) if run.mlflow else {}
    if step_metrics:
        run.mlflow.log(step_metrics, state.step)
    meter.step_done()
    if ctx.is_main and state.step % cfg.training.log_every == 0:
        log(meter.progress(state.step, run.total_steps, run.stop_at, state.epoch, result.loss, lr))
    return result


def report_launch(run: Run) -> None:
    """Rank 0 after its first step: the launch timeline, printed, in the event log and in MLflow.

    A restart inside the same ``fit()`` (a worker failed) times only its own worker: the driver's
    marks belong to the first attempt, which already reported them.
    """
    marks = {**run.launch_marks, "first_step": time.time()}
    fit = marks.get("fit")
    if fit is not None and any(e.get("fit") == fit for e in run.rundir.read_events("launch")):
        marks = {k: v for k, v in marks.items() if k in timeline.WORKER_MARKS}
    log(timeline.describe(marks))
    run.rundir.record_event("launch", **marks, **timeline.as_metrics(marks))
    if run.mlflow is not None:
        run.mlflow.log(timeline.as_metrics(marks), run.state.step)


def at_boundaries(run: Run, result: StepResult, end_of_epoch: bool) -> StepResult:
    """Evaluate, checkpoint (also on a preemption notice) and report when due: the same on every rank.

    The lean loop's unchecked losses are checked first: a non-finite one comes back (nothing saved).
    """
    state, cfg = run.state, run.cfg
    do_eval = (state.step % cfg.training.eval_every == 0) if cfg.training.eval_every else end_of_epoch
    preempted = run.preemption.requested(run.ctx, state.step)  # the process may end right after: save synchronously
    do_save = checkpoint_due(cfg, state.step, state.epoch, end_of_epoch) or preempted
    if do_eval or do_save:
        result = settle(run, result)
        if not result.finite:
            return result
    path = None
    if do_eval:
        state.metrics = summarize(run, result.grad_norm)
        if run.mlflow is not None:
            run.mlflow.log(state.metrics, state.step)
        if early_stop_due(run):
            run.stop_at = state.step  # the loop ends here: test metrics and the final checkpoint follow
    if do_save:
        path = run.saver.save(
            state.step, run.model, run.optimizer, run.scheduler, run.scaler, state, force_sync=preempted
        )
        run.saved_at_step = state.step
    if do_eval or do_save:  # a checkpoint-only report carries no stale eval metrics
        report(state.metrics if do_eval else {"step": state.step, "epoch": state.epoch}, path, run)
    run.preemption.exit_if_requested(run.ctx)
    return result


def check_due(run: Run) -> bool:
    """Whether the lean loop checks its losses after this step: a printed or logged step, the last, or a full window.

    The check is a collective: the answer depends on nothing that differs between ranks (only rank 0
    logs to MLflow, so ``tracking.enabled`` decides, not ``run.mlflow``).
    """
    step, cfg = run.state.step, run.cfg
    return (
        step % cfg.training.log_every == 0
        or (cfg.tracking.enabled and step % cfg.tracking.log_every == 0)
        or step >= run.stop_at
        or len(run.window) >= LEAN_WINDOW
    )


def settle(run: Run, result: StepResult) -> StepResult:
    """Check the lean loop's unchecked losses (one all-reduce) and count them into the train loss.

    Returns the newest step's result with its loss and gradient norm as numbers, or a non-finite
    result naming the first step whose loss was not finite. Without unchecked losses: ``result``.
    """
    if not run.window:
        return result
    count = len(run.window)
    checked, loss_sum = run.window.check(run.ctx)
    if checked.finite:
        run.state.loss_sum += loss_sum
        run.state.loss_count += count
    return checked


def early_stop_due(run: Run) -> bool:
    """``training.early_stop``: track the best eval value; True once ``patience`` evals in a row did not
    beat it by more than ``min_delta`` (the same decision on every rank: the metrics are all-reduced)."""
    stop, state = run.cfg.training.early_stop, run.state
    value = state.metrics.get(stop.metric)
    if not stop.patience or value is None:
        return False
    if state.best is None or (
        value > state.best + stop.min_delta if stop.mode == "max" else value < state.best - stop.min_delta
    ):
        state.best, state.evals_since_best = value, 0
        return False
    state.evals_since_best += 1
    if state.evals_since_best < stop.patience:
        return False
    run.early_stopped = {"early_stop/step": float(state.step), "early_stop/best": float(state.best)}
    if run.ctx.is_main:
        log(
            f"early stop at step {state.step} of {run.total_steps}: {stop.metric} {value:.4f} has not beaten "
            f"the best {state.best:.4f} by more than {stop.min_delta:g} for {stop.patience} eval(s)"
        )
    return True


def finish(run: Run) -> dict[str, Any]:
    """Test metrics, the final checkpoint (unless nothing trained since the resumed one), the last report."""
    state = run.state
    run.saver.wait()
    if not run.early_stopped:  # an early stop came right after this step's eval: its metrics stand
        state.metrics = summarize(run, state.metrics.get("train/grad_norm", 0.0))
    if run.data.test is not None:
        state.metrics.update(evaluate(run.model, run.data.test, run.cfg, run.ctx, "test", run.pipeline, run.task))
    if run.saved_at_step == state.step and run.resumed_from and state.step == run.resumed_from[1]:
        final = run.resumed_from[0]  # nothing trained since: that checkpoint is the final state
    else:
        final = run.saver.save(state.step, run.model, run.optimizer, run.scheduler, run.scaler, state, force_sync=True)
    run.saver.close()
    state.metrics["checkpoint/blocked_s"] = sum(run.saver.blocked_s) / max(1, len(run.saver.blocked_s))
    state.metrics.update(run.early_stopped)
    if run.mlflow is not None:
        run.mlflow.log(state.metrics, state.step)
        if not run.mlflow.close(timeout=30):
            log(f"MLflow unreachable at the end: metrics stay spooled in {run.mlflow.spool}; the driver retries")
    report(state.metrics, final, run)
    return {"stopped": "done", "step": state.step}


def new_saver(cfg: RunConfig, ctx: WorkerContext, layout: parallel.Layout, store: RunStore | None) -> Saver:
    """The run's checkpoint writer, with ``checkpoint.*``'s retention and the source of a resume protected."""
    c = cfg.checkpoint
    return Saver(
        cfg.run_dir, ctx, redacted_dump(cfg), c.keep_last, c.keep_best, c.metric, c.mode, c.async_save, store,
        protect=c.resume_from, same_buffers=layout.same_buffers,
    )  # fmt: skip


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


def summarize(run: Run, grad_norm: float) -> dict[str, float]:
    """The metrics of a report: the train-loss mean since the last report (then reset), LR, eval, MFU."""
    state, ctx, meter = run.state, run.ctx, run.meter
    loss_sum, count = all_reduce_sum([state.loss_sum, state.loss_count], ctx)
    state.loss_sum, state.loss_count = 0.0, 0
    samples_per_s = meter.samples_per_s()
    return {
        "step": state.step,
        "epoch": state.epoch,
        **({"train/loss": loss_sum / count} if count else {}),  # none when no step trained since the last
        "train/lr": run.scheduler.get_last_lr()[0],
        "train/grad_norm": grad_norm,
        "train/samples_per_s": samples_per_s,
        "perf/data_wait_fraction": state.data_wait_s / max(meter.train_s, 1e-9),
        **evaluate(run.model, run.data.val, run.cfg, ctx, "val", run.pipeline, run.task),
        **memory_metrics(ctx),
        "perf/mfu": meter.mfu(samples_per_s),
    }


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


def start_metrics_logger(run: Run) -> Any:
    """Rank 0's MLflow logger for the run the driver made (None on other ranks or without tracking)."""
    info = run.plan.tracking
    if not run.ctx.is_main or not run.cfg.tracking.enabled or info is None:
        return None
    from rayjobs.tracking import MetricsLogger

    return MetricsLogger(run.cfg, info.run_id, info.run_key, info.spool, attempt=run.rundir.next_attempt())


def stop_on_nan(run: Run, result: StepResult) -> dict[str, Any]:
    """Every rank stops at the same step; the driver turns this report into a clear failure.

    The step named is the first whose loss was not finite (the lean loop finds it at its next check).
    """
    step, bad_ranks = result.at_step or run.state.step + 1, result.bad_ranks
    run.saver.wait()
    if run.ctx.is_main:
        found = f" (found at step {run.state.step})" if result.at_step and result.at_step != run.state.step else ""
        log(
            f"step {step}: non-finite loss on rank(s) {bad_ranks}{found}; every rank stops without saving it "
            "(training.nan_policy=stop)"
        )
    report({"step": step, "nan/stop_step": step}, None, run)
    return {"stopped": "nan", "step": step, "ranks": bad_ranks}


def report(metrics: dict[str, Any], checkpoint_path: str | None, run: Run) -> None:
    """``ray.train.report`` on every rank (a barrier); rank 0 names the committed checkpoint.

    Checkpoints are written straight into the run's storage by DCP, so Ray Train only records
    them (``NO_UPLOAD``). In local mode (no controller) the metrics history is written here.
    """
    import ray.train
    from ray.train import CheckpointUploadMode

    if run.plan.local_mode:
        run.rundir.append_history(metrics)
    checkpoint = ray.train.Checkpoint(checkpoint_path) if checkpoint_path else None
    if checkpoint is not None and run.store is not None and not run.plan.local_mode:
        # Uploaded already (Saver): Ray records its place in the bucket, on the filesystem Ray was given.
        fs = ray.train.get_context().get_storage().storage_filesystem
        checkpoint = ray.train.Checkpoint(run.store.path(os.path.basename(checkpoint_path)), filesystem=fs)
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
