"""Driver of one training run: config -> ``TorchTrainer`` -> ``fit()`` -> summary.

Run it with ``rayjobs train [--config FILE] [--set k=v ...]`` or, the same thing,
``python -m rayjobs.train [--config FILE] [--set k=v ...]`` (what ``ray job submit`` runs):

    python -m rayjobs.train --config rayjobs/configs/digits.yaml --summary results/summary.json
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayjobs import launch, log, paths, preflight, storage, timeline
from rayjobs.config import RunConfig
from rayjobs.errors import ConfigError, ExplainedFailure, Interrupted, TrainingFailed
from rayjobs.lease import Lease
from rayjobs.plan import LaunchPlan, ScalingPlan, StreamPlan, TrackingPlan
from rayjobs.rundir import RunDir


def run(
    cfg: RunConfig,
    *,
    callbacks: list[Any] | None = None,
    mlflow_tags: dict[str, str] | None = None,
    stop_at_step: int | None = None,
    final: bool = True,
    exploit: bool = False,
) -> dict[str, Any]:
    """Train one run with Ray Train and return its summary (see ``write_summary``).

    Tune's trial driver adds ``callbacks`` (TuneReportCallback), tags the MLflow child run
    (``mlflow_tags``), and, for population-based training, stops at ``stop_at_step`` (a segment;
    ``final=False`` leaves the MLflow run open and logs no end-of-run artifacts; ``exploit``: its
    ``checkpoint.resume_from`` replaces the trial's own newest checkpoint, a PBT exploit).
    """
    for note in paths.resolve(cfg):
        log.note(note)
    preflight.check_writable_dir(cfg.run_dir)
    held = Lease(cfg.run_dir).acquire()  # one live driver per run directory
    try:
        return _run(
            cfg, callbacks=callbacks, mlflow_tags=mlflow_tags, stop_at_step=stop_at_step, final=final, exploit=exploit
        )
    finally:
        held.release()


@dataclass
class Prepared:
    """What the driver knows before Ray starts: the scaling, a streamed source, the store, the estimate."""

    cfg: RunConfig
    scaling: ScalingPlan
    local_mode: bool
    source: Any = None  # a streamed dataset's source (rayjobs.ray_data), None for in-memory data
    store: Any = None  # the run's object store directory, None for a filesystem path
    memory_estimate: float | None = None
    init_from: str = ""  # model.init_from as a local checkpoint directory

    @property
    def rundir(self) -> RunDir:
        """The run's directory (local: the driver's side of an object store run)."""
        return RunDir(self.cfg.run_dir)


def prepare(cfg: RunConfig) -> Prepared:
    """Every check before Ray starts (packages, resume source, data, scaling, store, memory): one line each."""
    missing = preflight.missing_packages(cfg, ("data.name",))
    if missing:
        raise ConfigError(missing)
    launch.poll_reports_often()
    preflight.check_resume_from(cfg)
    init_from = preflight.check_init_from(cfg)
    preflight.check_optimizer(cfg)
    source = preflight.check_data(cfg)
    preflight.check_model_builds(cfg)  # the data's shapes size it
    local_mode = cfg.scaling.num_workers == 0
    scaling = launch.plan_scaling(cfg, launch.local_gpu_count() if local_mode else launch.cluster_gpu_count())
    preflight.note_max_steps_past_the_end(cfg, preflight.check_train_rows(cfg, source, scaling.world_size))
    store = open_store(cfg)
    preflight.check_own_checkpoints(cfg, store)
    estimate = preflight.memory_estimate(cfg, scaling.world_size, scaling.use_gpu)
    return Prepared(cfg, scaling, local_mode, source, store, estimate, init_from)


def launch_plan(
    prep: Prepared,
    mlflow_run_id: str | None,
    stop_at_step: int | None,
    exploit: bool,
    launch_marks: dict[str, float] | None = None,
) -> LaunchPlan:
    """The contract the workers get: the config and everything the driver resolved (Ray is up);
    ``launch_marks`` are the driver's marks of ``rayjobs.timeline`` so far."""
    cfg, scaling, rundir = prep.cfg, prep.scaling, prep.rundir
    stream = None
    if prep.source is not None:
        from rayjobs import ray_data

        info = prep.source.info
        stream = StreamPlan(
            info.kind, tuple(info.input_shape), info.num_classes, prep.source.rows["train"],
            "test" in prep.source.paths, scaling.world_size, ray_data.fits_in_memory(prep.source, scaling.world_size),
        )  # fmt: skip
    return LaunchPlan(
        config=cfg.model_dump(mode="json"),
        use_gpu=scaling.use_gpu,
        cpus_per_worker=scaling.cpus_per_worker,
        local_mode=prep.local_mode,
        stop_at_step=stop_at_step,
        exploit=exploit,
        memory_estimate_bytes=prep.memory_estimate,
        storage_mark=None if prep.local_mode else storage.mark(cfg.run_dir, prep.store),
        tracking=TrackingPlan(mlflow_run_id, rundir.path, rundir.spool),
        stream=stream,
        init_from=prep.init_from,
        launch_marks=dict(launch_marks or {}),
    )


def _run(
    cfg: RunConfig,
    *,
    callbacks: list[Any] | None,
    mlflow_tags: dict[str, str] | None,
    stop_at_step: int | None,
    final: bool,
    exploit: bool,
) -> dict[str, Any]:
    started = time.time()
    marks = {"driver_start": timeline.driver_start()}
    prep = prepare(cfg)
    import_fit_modules()
    mlflow_run_id = start_ray_and_tracking(prep, mlflow_tags, marks)
    plan = launch_plan(prep, mlflow_run_id, stop_at_step, exploit, marks)
    try:
        result = fit(prep, plan, callbacks)
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C: Ray Train aborts the workers, then its ray.get exits
        finish_tracking(cfg, mlflow_run_id, None, failed=True, status="KILLED")
        newest = newest_good_checkpoint(prep)
        raise Interrupted(
            f"interrupted; newest checkpoint {newest}: the same command resumes from it"
            if newest
            else "interrupted before the first checkpoint: the same command starts over"
        ) from None
    except Exception as exc:  # TrainingFailedError and friends: the training itself failed
        finish_tracking(cfg, mlflow_run_id, None, failed=True)
        if _explained(exc):  # its message says it all: no traceback
            raise TrainingFailed(_first_line(exc)) from None
        raise TrainingFailed(_first_line(exc)) from exc
    ended = result.return_value or {}
    if ended.get("stopped") == "nan":
        raise TrainingFailed(nan_failure(prep, ended))
    summary = summarize(prep, result, started)
    if cfg.tracking.enabled:
        summary["mlflow_run_id"] = finish_tracking(cfg, mlflow_run_id, summary, final=final)
    return summary


def start_ray_and_tracking(prep: Prepared, mlflow_tags: dict[str, str] | None, marks: dict[str, float]) -> str | None:
    """Start or join Ray, and open the run's MLflow run (its id, None without tracking); marks
    ``ray_start``, ``ray_ready`` and ``tracking_ready`` in ``marks``.

    Where this driver starts a local Ray, the MLflow run is made while Ray starts: each takes about
    3 s on 2 cores (a new ``mlflow.db`` is migrated), and the driver mostly waits on Ray's processes.
    A Ray that fails to start ends the MLflow run made beside it, KILLED on Ctrl-C, else FAILED.
    """
    cfg = prep.cfg
    marks["ray_start"] = time.time()
    if prep.local_mode:
        logging.getLogger("ray.train").setLevel(logging.WARNING)  # not one INFO line per report
    # Ray Data reads need a Ray in local mode too. Left to Ray Data's own `ray.init()`, a run joined
    # any `ray start` cluster on the machine, or took port 8265 that `rayjobs cluster up` then refused.
    needs_ray = not prep.local_mode or prep.source is not None
    # Joining a cluster is quick (its nodes are tagged); a local Ray's start is overlapped with the MLflow run.
    if needs_ray and cfg.tracking.enabled and not launch.existing_cluster():
        with ThreadPoolExecutor(1, thread_name_prefix="mlflow-run") as pool:
            opening = pool.submit(start_tracking, cfg, prep.scaling, mlflow_tags, 1)
            try:
                launch.init_ray(prep.scaling, streaming=prep.source is not None)
            except BaseException as exc:
                interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
                finish_tracking(cfg, opening.result(), None, failed=True, status="KILLED" if interrupted else "FAILED")
                raise
            marks["ray_ready"] = time.time()
            run_id = opening.result()
    else:
        if needs_ray:
            launch.init_ray(prep.scaling, streaming=prep.source is not None)
        marks["ray_ready"] = time.time()
        run_id = start_tracking(cfg, prep.scaling, mlflow_tags) if cfg.tracking.enabled else None
    marks["tracking_ready"] = time.time()
    return run_id


def import_fit_modules() -> None:
    """Import what ``fit`` builds the trainer from (Ray Train, the worker loop: 1-2 s on 2 cores) once the
    checks have passed, so that the launch timeline counts it in ``driver``, not in ``datasets``."""
    import ray.train  # noqa: F401

    import rayjobs.loop  # noqa: F401
    import rayjobs.trainer  # noqa: F401


def fit(prep: Prepared, plan: LaunchPlan, callbacks: list[Any] | None) -> Any:
    """Build the ``TorchTrainer`` (``rayjobs.trainer``) for this plan and fit it; the Result (its error raised)."""
    from ray.train import DataConfig, FailureConfig, LoggingConfig, ScalingConfig
    from ray.train import RunConfig as RayRunConfig

    from rayjobs.loop import train_fn_per_worker
    from rayjobs.trainer import Trainer

    cfg, scaling, store = prep.cfg, prep.scaling, prep.store
    datasets = None
    if prep.source is not None:  # streamed through Ray Data: train is split over the workers, val/test are not
        from rayjobs import ray_data

        datasets = ray_data.datasets(prep.source, cfg.data.kwargs)
        if plan.stream is not None and plan.stream.in_memory:
            datasets = ray_data.read_evaluation_splits_once(datasets)
    if not prep.local_mode:
        from rayjobs.checkpoint import reconcile_ray_snapshot

        reconcile_ray_snapshot(cfg.run_dir, store)  # a re-run's controller must not trip on checkpoints we pruned
    plan = dataclasses.replace(plan, launch_marks={**plan.launch_marks, "fit": time.time()})
    trainer = Trainer(
        train_fn_per_worker,
        own_local_ray=launch.owns_local_ray(),
        train_loop_config=plan.to_dict(),
        datasets=datasets,
        dataset_config=DataConfig(datasets_to_split=["train"]),
        scaling_config=ScalingConfig(
            num_workers=(scaling.num_workers, scaling.max_workers) if scaling.max_workers else scaling.num_workers,
            elastic_resize_monitor_interval_s=cfg.scaling.elastic_resize_interval_s,
            use_gpu=scaling.use_gpu,
            resources_per_worker=scaling.resources_per_worker,
            accelerator_type=cfg.scaling.accelerator_type or None,
        ),
        run_config=RayRunConfig(
            name=cfg.run.name,
            storage_path=store.base if store else cfg.storage_path,
            storage_filesystem=store.fs if store else None,
            failure_config=FailureConfig(max_failures=cfg.failure.max_failures),
            logging_config=LoggingConfig(log_level="WARNING"),
            callbacks=[] if prep.local_mode else [_history_callback(prep.rundir), *(callbacks or [])],
            worker_runtime_env=worker_runtime_env(cfg),
        ),
    )
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    return result


def newest_good_checkpoint(prep: Prepared) -> str | None:
    """The run's newest complete checkpoint (in its bucket, with an object store), or None."""
    from rayjobs.checkpoint import latest_complete, list_bucket_checkpoints

    if prep.store is not None:
        return next((str(c.path) for c in reversed(list_bucket_checkpoints(prep.store)) if c.complete), None)
    good = latest_complete(prep.cfg.run_dir, warn=False)
    return str(good.path) if good else None


def nan_failure(prep: Prepared, ended: dict[str, Any]) -> str:
    """The one line of a run every rank stopped on a non-finite loss, with its last good checkpoint."""
    good_path = newest_good_checkpoint(prep)
    ranks = ", ".join(map(str, ended["ranks"]))
    return (
        f"non-finite loss at step {ended['step']} on rank(s) {ranks}; every rank "
        f"stopped without saving it; last good checkpoint: {good_path or 'none'}. Try a lower optim.lr, "
        f"optim.grad_clip, or training.nan_policy=skip"
    )


def summarize(prep: Prepared, result: Any, started: float) -> dict[str, Any]:
    """The run's summary (see ``write_summary``); an object store run's final checkpoint fetched locally."""
    metrics = {k: v for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))}
    summary = {
        "run_name": prep.cfg.run.name,
        "storage_path": prep.cfg.run_dir,
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
        "checkpoint_uri": None,
        "mlflow_run_id": None,
        "wall_s": round(time.time() - started, 2),
        "samples_per_s": metrics.get("train/samples_per_s"),
        "num_workers": prep.scaling.num_workers,
        "device": "gpu" if prep.scaling.use_gpu else "cpu",
        "metrics": metrics,
        "history": prep.rundir.metrics,
    }
    launches = [e for e in prep.rundir.read_events("launch") if e["time"] >= started]
    if launches:  # rank 0's timeline (absent when the run directory is not on this machine)
        summary["launch"] = {k: v for k, v in launches[0].items() if k.startswith("launch/")}
    if "early_stop/step" in metrics:
        stop = prep.cfg.training.early_stop
        summary["early_stop"] = (
            f"stopped early at step {metrics['early_stop/step']:.0f}: {stop.metric} did not beat its best "
            f"{metrics['early_stop/best']:.4f} ({stop.mode}) by more than {stop.min_delta:g} for {stop.patience} eval(s)"
        )
    if prep.store is not None and summary["checkpoint"]:
        summary["checkpoint_uri"], summary["checkpoint"] = fetch_final(
            prep.store, prep.cfg.run_dir, summary["checkpoint"]
        )
    return summary


def _history_callback(rundir: RunDir) -> Any:
    from ray.train import UserCallback

    class MetricsHistory(UserCallback):
        """Runs in the Train controller (driver's node): appends rank 0's metrics of each report."""

        def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
            rundir.append_history(metrics[0])

    return MetricsHistory()


def worker_runtime_env(cfg: RunConfig) -> dict[str, Any]:
    """What the workers' environment needs: the MLflow URI and credentials."""
    if not cfg.tracking.enabled:
        return {}
    from rayjobs.tracking import worker_env

    return {"env_vars": worker_env(cfg)}


def open_store(cfg: RunConfig) -> Any:
    """The run's directory in the object store of run.storage_path, or None for a filesystem path."""
    if not cfg.storage_uri:
        return None
    from rayjobs.storage.bucket import RunStore

    store = RunStore(cfg.storage_uri, cfg.run.name)
    store.check()  # before Ray starts: a wrong endpoint or missing credentials fail here, in one line
    return store


def fetch_final(store: Any, run_dir: str, reported: str) -> tuple[str, str]:
    """(its URL, a local copy) of the final checkpoint Ray reported in the bucket: the driver logs the local copy."""
    name = os.path.basename(reported.rstrip("/"))
    local = os.path.join(run_dir, name)
    from rayjobs.checkpoint import fetch

    problem = fetch(store, name, Path(local))
    if problem:
        raise TrainingFailed(f"the final checkpoint {store.url(name)} does not match its manifest: {problem}")
    return store.url(name), local


def start_tracking(
    cfg: RunConfig, plan: ScalingPlan, extra_tags: dict[str, str] | None = None, nodes: int | None = None
) -> str | None:
    """Find or create the run's MLflow run and log its params and tags; None (one warning) if MLflow is away.
    ``nodes`` (the run's Ray nodes) is asked of Ray where not given."""
    from rayjobs import tracking

    try:
        if nodes is None:
            ray = sys.modules.get("ray")
            nodes = sum(1 for n in ray.nodes() if n.get("Alive")) if ray is not None and ray.is_initialized() else 1
        tags = {
            **tracking.run_tags(cfg, plan.world_size, "gpu" if plan.use_gpu else "cpu", nodes),
            **(extra_tags or {}),
        }
        tracker = tracking.Tracker(cfg)
        run_id = tracker.open(cfg.run_dir, tags)
        tracker.log_params(run_id, tracking.flatten(cfg.model_dump(mode="json")))
        return run_id
    except Exception as exc:  # noqa: BLE001 - tracking never stops training
        log.warn(
            f"MLflow at {tracking.tracking_uri(cfg)} is unavailable ({type(exc).__name__}); "
            "training goes on and rank 0 spools its metrics until it is back"
        )
        return None


def finish_tracking(
    cfg: RunConfig,
    run_id: str | None,
    summary: dict[str, Any] | None,
    failed: bool = False,
    wait_s: float = 90.0,
    final: bool = True,
    status: str = "FAILED",
) -> str | None:
    """Replay anything spooled, log the end-of-run artifacts and model, end the MLflow run
    (``failed``: ended with ``status``, FAILED or KILLED).

    An outage during the run is waited out for ``wait_s``; a server never reached (no run opened at
    the start, e.g. a mistyped ``tracking.uri``) is tried once: the spool keeps the metrics.
    """
    if not cfg.tracking.enabled:  # a failed or interrupted run without tracking opens no MLflow run
        return None
    from rayjobs import tracking

    spool, tracker = RunDir(cfg.run_dir).spool, tracking.Tracker(cfg)
    deadline = time.time() + (wait_s if run_id else 0.0)
    while True:
        try:
            run_id = run_id or tracker.open(cfg.run_dir)
            replay = tracking.has_pending(spool)
            if replay and not tracking.MetricsLogger(cfg, run_id, cfg.run_dir, spool).close(30):
                raise ConnectionError("spool not replayed")
            if failed:
                tracker.end(run_id, status)
            elif final:
                tracker.finish(run_id, summary or {}, RunDir(cfg.run_dir).read_history())
            return run_id
        except Exception as exc:  # noqa: BLE001
            if failed or time.time() > deadline:
                log.warn(
                    f"could not finish the MLflow run ({type(exc).__name__}: {exc}); "
                    f"spooled metrics (if any) stay in {spool} for the next run with this run.name"
                )
                return run_id
            time.sleep(3)


def _explained(exc: BaseException) -> bool:
    failures = list(getattr(exc, "worker_failures", {}).values())
    return any(isinstance(e, ExplainedFailure) for e in [exc, *failures])


EXCEPTION_LINE = re.compile(r"^(?:[a-z_]\w*\.)*[A-Z]\w*: ")  # "pkg.mod.SomeError: message"


def _first_line(exc: BaseException) -> str:
    """One line for a failed run: a worker's own error (the last line of its traceback) when there is one."""
    failures = getattr(exc, "worker_failures", None)
    if failures:
        rank = min(failures)
        lines = str(failures[rank]).strip().splitlines()
        # The worker's own exception line, not a hint that a library printed after it.
        raised = [line.strip() for line in lines if EXCEPTION_LINE.match(line.strip())]
        return f"rank {rank}: {raised[-1] if raised else lines[-1] if lines else type(failures[rank]).__name__}"
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text.splitlines()[0]}"


def format_summary(summary: dict[str, Any]) -> str:
    """The short console summary printed at the end of a run."""
    m = summary["metrics"]
    keys = ["train/loss"]
    for prefix in ("val/", "test/"):  # the task's metrics, its loss first
        keys += sorted((k for k in m if k.startswith(prefix)), key=lambda k, p=prefix: k != f"{p}loss")
    shown = "  ".join(f"{k} {m[k]:.4f}" for k in keys if k in m)
    workers = summary["num_workers"] or "local mode, 1"
    lines = [
        f"rayjobs: run {summary['run_name']} finished in {summary['wall_s']:.1f} s "
        f"({workers} worker(s), {summary['device']}, {m.get('step', 0):.0f} steps)",
        f"  {shown}",
        (
            f"  throughput: {summary['samples_per_s']:.0f} samples/s"
            if summary["samples_per_s"]
            else "  throughput: no step trained: the run had already finished (a new run.name trains afresh)"
        ),
        f"  results:    {summary['storage_path']}",
        f"  checkpoint: {summary['checkpoint']}",
    ]
    if summary.get("checkpoint_uri"):
        lines.append(f"  in bucket:  {summary['checkpoint_uri']}")
    if summary.get("early_stop"):
        lines.append(f"  {summary['early_stop']}")
    return "\n".join(lines)


def write_summary(summary: dict[str, Any], path: str) -> None:
    """Write the run summary as JSON (keys: run_name, storage_path, checkpoint, mlflow_run_id,
    wall_s, samples_per_s, metrics)."""
    from rayjobs.storage.local import LocalStore

    target = os.path.abspath(path)
    try:  # through a temporary file and a rename: a failed write keeps an earlier summary whole
        text = json.dumps(summary, indent=2, sort_keys=True)
        LocalStore(os.path.dirname(target)).write_bytes(os.path.basename(target), text.encode())
    except OSError as exc:
        raise ConfigError(f"--summary: cannot write {path}: {exc.strerror or exc}") from None


if __name__ == "__main__":  # ``python -m rayjobs.train`` is ``rayjobs train`` (what ``ray job submit`` runs)
    from rayjobs.cli import main

    main(["train", *sys.argv[1:]])
