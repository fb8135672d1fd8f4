"""Driver of one training run: config -> ``TorchTrainer`` -> ``fit()`` -> summary.

Run it with ``rayjobs train [--config FILE] [--set k=v ...]`` or, the same thing,
``python -m rayjobs.train [--config FILE] [--set k=v ...]`` (what ``ray job submit`` runs):

    python -m rayjobs.train --config rayjobs/configs/digits.yaml --summary results/summary.json
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayjobs import paths, preflight, storage
from rayjobs.config import RunConfig
from rayjobs.errors import ConfigError, TrainingFailed
from rayjobs.lease import Lease


@dataclass(frozen=True)
class ScalingPlan:
    """The resolved scaling of a run: what ``auto`` became on this machine or cluster."""

    num_workers: int
    use_gpu: bool
    resources_per_worker: dict[str, float]
    max_workers: int = 0  # elastic runs: grow from num_workers up to this; 0 = a fixed size

    @property
    def world_size(self) -> int:
        """Processes in the job (local mode counts as one)."""
        return max(1, self.num_workers)


def append_history(path: str, metrics: dict[str, Any]) -> None:
    """Append one report's numeric metrics to the run's ``metrics.jsonl``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        entry = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        f.write(json.dumps({**entry, "time": time.time()}) + "\n")


def record_event(run_dir: str, event: str, **fields: Any) -> None:
    """Append ``{event, time, ...}`` to the run's ``events.jsonl`` (start and first-step times)."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "events.jsonl"), "a") as f:
        f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


def read_events(run_dir: str, event: str) -> list[dict[str, Any]]:
    """Every ``event`` entry of the run's ``events.jsonl``, oldest first."""
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [e for e in map(json.loads, filter(str.strip, f)) if e.get("event") == event]


def read_history(path: str) -> list[dict[str, Any]]:
    """Every report of a run by step, oldest first; a step replayed after a resume counts once (the last)."""
    if not os.path.exists(path):
        return []
    by_step: dict[Any, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                entry = json.loads(line)
                by_step[entry.get("step")] = entry
    return sorted(by_step.values(), key=lambda e: e.get("step") or 0)


def _history_callback(path: str) -> Any:
    from ray.train import UserCallback

    class MetricsHistory(UserCallback):
        """Runs in the Train controller (driver's node): appends rank 0's metrics of each report."""

        def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
            append_history(path, metrics[0])

    return MetricsHistory()


def _existing_cluster() -> bool:
    """True when this driver runs against a cluster (RAY_ADDRESS, or Ray already initialized)."""
    ray = sys.modules.get("ray")  # never import Ray just to ask: bad input must not start it
    return bool(os.environ.get("RAY_ADDRESS")) or bool(ray is not None and ray.is_initialized())


def local_gpu_count() -> int:
    """GPUs visible to this process (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_scaling(cfg: RunConfig, gpus_available: int) -> ScalingPlan:
    """Resolve ``auto`` values and check the plan against the config; ConfigError when they clash."""
    s = cfg.scaling
    use_gpu = gpus_available > 0 if s.use_gpu == "auto" else bool(s.use_gpu)
    max_workers = 0
    if s.num_workers == "auto":
        num_workers = gpus_available if use_gpu and gpus_available else 2
    elif isinstance(s.num_workers, list):
        num_workers, max_workers = s.num_workers
    else:
        num_workers = s.num_workers
    resources = dict(s.resources_per_worker) or {"CPU": 1.0}
    plan = ScalingPlan(num_workers, use_gpu, resources, max_workers)
    from rayjobs.strategies import layout_problems, resolve_layout

    problems = layout_problems(cfg, plan.world_size, use_gpu)
    if max_workers:
        problems += elastic_problems(cfg, num_workers, max_workers)
    replicas = resolve_layout(cfg.parallel, plan.world_size).dp if not problems else plan.world_size
    parts = replicas * cfg.training.grad_accum
    if cfg.training.batch_size % parts:
        who = "workers" if replicas == plan.world_size else "data-parallel replicas"
        problems.append(
            f"training.batch_size: must be a multiple of {who} ({replicas}) x grad_accum "
            f"({cfg.training.grad_accum}) = {parts}, got {cfg.training.batch_size}"
        )
    if cfg.training.precision == "fp16" and not use_gpu:
        problems.append("training.precision: fp16 needs a GPU; use bf16 or fp32 on CPU, got 'fp16'")
    if s.accelerator_type and not use_gpu:
        problems.append(
            f"scaling.accelerator_type={s.accelerator_type} pins GPU workers, but this run uses no GPU; "
            "set scaling.use_gpu=true, or leave accelerator_type empty"
        )
    if use_gpu and s.use_gpu is True and gpus_available == 0 and not _existing_cluster():
        problems.append("scaling.use_gpu: true, but this machine has no GPU; set it to auto or false")
    f = cfg.faults
    for name, rank in (("faults.kill_rank", f.kill_rank), ("faults.nan_rank", f.nan_rank)):
        if rank >= plan.world_size:
            problems.append(f"{name}: must be a rank below the world size {plan.world_size}, got {rank}")
    if problems:
        raise ConfigError(problems)
    return plan


def elastic_problems(cfg: RunConfig, low: int, high: int) -> list[str]:
    """An elastic run changes its world size: only pure data parallelism, and a batch every size divides."""
    problems = []
    strategy = cfg.parallel.strategy
    degrees = [k for k in ("dp_replicate", "dp_shard", "tp", "pp") if getattr(cfg.parallel, k)]
    if strategy not in ("ddp", "fsdp") or degrees:
        fixed = f"parallel.{degrees[0]} fixed" if degrees else f"parallel.strategy {strategy}"
        problems.append(
            f"scaling.num_workers=[{low}, {high}] (elastic) needs parallel.strategy ddp or fsdp with derived "
            f"degrees, got {fixed}; give a fixed number of workers for other layouts"
        )
    bad = [w for w in range(low, high + 1) if cfg.training.batch_size % (w * cfg.training.grad_accum)]
    if bad:
        problems.append(
            f"training.batch_size: an elastic run keeps the global batch at every size from {low} to {high} "
            f"workers, but {cfg.training.batch_size} does not divide over {bad[0]} x grad_accum "
            f"{cfg.training.grad_accum}; pick a multiple of each"
        )
    if cfg.failure.max_failures == 0:
        problems.append(
            "failure.max_failures: an elastic run restarts its worker group when a node leaves; set it above 0 (or -1)"
        )
    return problems


def check_data(cfg: RunConfig) -> Any:
    """A streamed dataset's source, checked before Ray starts (None for in-memory datasets)."""
    from rayjobs import data as data_lib

    if not data_lib.is_streaming(cfg.data.name):
        return None
    from rayjobs.ray_data import DataError

    if cfg.parallel.tp > 1 or cfg.parallel.pp > 1 or cfg.parallel.strategy in ("tp", "pp", "fsdp+tp", "pp+dp"):
        raise ConfigError(
            f"data.name={cfg.data.name} streams a different shard to every worker; tensor and pipeline "
            f"parallel ranks need the same batches: use parallel.strategy ddp, fsdp or hsdp"
        )
    try:
        return data_lib.DATASETS[cfg.data.name].load(**cfg.data.kwargs)
    except DataError as exc:
        raise ConfigError(str(exc)) from None


def print_memory_estimate(cfg: RunConfig, plan: ScalingPlan) -> float | None:
    """Print what one rank will hold (parameters, gradients, optimizer state, activations); return the total."""
    from rayjobs.memory import estimate
    from rayjobs.strategies import resolve_layout

    layout = resolve_layout(cfg.parallel, plan.world_size)
    try:
        est = estimate(cfg, layout, plan.use_gpu)
    except Exception as exc:  # noqa: BLE001 - a user's model may not run on the meta device
        print(f"rayjobs: no memory estimate ({cfg.model.name} does not run on the meta device: {exc})", flush=True)
        return None
    print(f"rayjobs: {est.format(layout)}", flush=True)
    return est.total


def check_resume_from(cfg: RunConfig) -> None:
    """An explicit ``checkpoint.resume_from`` must be a complete checkpoint (checked before Ray starts)."""
    if not cfg.checkpoint.resume_from:
        return
    from rayjobs.checkpoint import verify

    path = os.path.abspath(cfg.checkpoint.resume_from)
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint.resume_from: no checkpoint directory at {path}")
    problem = verify(path)
    if problem:
        raise ConfigError(f"checkpoint.resume_from: {path} is not a complete checkpoint: {problem}")
    cfg.checkpoint.resume_from = path


def init_ray(plan: ScalingPlan, streaming: bool = False) -> None:
    """Connect to the cluster in RAY_ADDRESS, or start a local Ray sized for the plan.

    A streamed dataset (Ray Data) needs CPUs beside the training workers for its read and
    ``map_batches`` tasks: a local Ray gets one more; on a running cluster a warning says so.
    """
    import ray

    cpus_needed = plan.num_workers * plan.resources_per_worker.get("CPU", 1.0)
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        if not ray.is_initialized():
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        cluster_cpus = ray.cluster_resources().get("CPU", 0.0)
        if streaming and cluster_cpus - cpus_needed < 1:
            print(
                f"rayjobs: warning: Ray Data reads on CPUs beside the training workers, and this cluster has {cluster_cpus:g} "
                f"CPU(s) with {cpus_needed:g} taken by the workers: reading waits for an autoscaled node; "
                "lower scaling.resources_per_worker.CPU (e.g. 0.5) to leave it one",
                file=sys.stderr,
                flush=True,
            )
        return
    cpus_needed += 1 if streaming else 0
    # The driver's directory on the workers' path, so a user's `pkg.module:callable` model imports.
    path = os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p)
    # Starting a worker group takes long on a loaded small machine (several trials at once):
    # Ray's 60 s default turns that into restart loops.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "300")
    ray.init(
        address="local",  # a new Ray of our own, even where a `ray start` cluster runs (RAY_ADDRESS picks that)
        num_cpus=max(os.cpu_count() or 1, int(cpus_needed + 0.999)),
        runtime_env={
            "env_vars": {
                "PYTHONPATH": path,
                "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"],
            }
        },
        log_to_driver=True,
    )


def cluster_gpu_count() -> int:
    """GPUs in the cluster this driver will use (the running cluster's, else this machine's)."""
    if _existing_cluster():
        import ray

        if not ray.is_initialized():
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return int(ray.cluster_resources().get("GPU", 0))
    return local_gpu_count()


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
        print(f"rayjobs: {note}", flush=True)
    held = Lease(cfg.run_dir).acquire()  # one live driver per run directory
    try:
        return _run(
            cfg, callbacks=callbacks, mlflow_tags=mlflow_tags, stop_at_step=stop_at_step, final=final, exploit=exploit
        )
    finally:
        held.release()


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
    missing = preflight.missing_packages(cfg, ("data.name",))
    if missing:
        raise ConfigError(missing)
    check_resume_from(cfg)
    source = check_data(cfg)
    local_mode = cfg.scaling.num_workers == 0
    plan = plan_scaling(cfg, local_gpu_count() if local_mode else cluster_gpu_count())

    from ray.train import DataConfig, FailureConfig, LoggingConfig, ScalingConfig
    from ray.train import RunConfig as RayRunConfig
    from ray.train.torch import TorchTrainer

    from rayjobs.loop import train_fn_per_worker

    run_dir = os.path.join(cfg.storage_path, cfg.run.name)
    store = open_store(cfg)
    history_path = os.path.join(run_dir, "metrics.jsonl")
    estimate = print_memory_estimate(cfg, plan)
    if local_mode:
        logging.getLogger("ray.train").setLevel(logging.WARNING)  # not one INFO line per report
    else:
        init_ray(plan, streaming=source is not None)
    mlflow_run_id = start_tracking(cfg, plan, mlflow_tags) if cfg.tracking.enabled else None
    loop_config = cfg.model_dump(mode="json")
    loop_config["_resolved"] = {
        "use_gpu": plan.use_gpu,
        "cpus_per_worker": plan.resources_per_worker.get("CPU", 1.0),
        "local_mode": local_mode,
        "local_history_path": history_path if local_mode else None,
        "stop_at_step": stop_at_step,
        "exploit": exploit,
        "memory_estimate_bytes": estimate,
        "storage_mark": None if local_mode else storage.mark(run_dir, store),
        "mlflow": {"run_id": mlflow_run_id, "run_key": run_dir, "spool": os.path.join(run_dir, ".mlflow-spool.jsonl")},
    }
    datasets = None
    if source is not None:  # streamed through Ray Data: train is split over the workers, val/test are not
        from rayjobs import ray_data

        datasets = ray_data.datasets(source, cfg.data.kwargs)
        loop_config["_resolved"]["streaming"] = {
            "kind": source.info.kind,
            "shape": list(source.info.input_shape),
            "classes": source.info.num_classes,
            "train_rows": source.rows["train"],
            "has_test": "test" in source.paths,
            "world_size": plan.world_size,
            "in_memory": ray_data.fits_in_memory(source, plan.world_size),
        }
    if not local_mode:
        from rayjobs.checkpoint import reconcile_ray_snapshot

        reconcile_ray_snapshot(run_dir, store)  # a re-run's controller must not trip on checkpoints we pruned
    trainer = TorchTrainer(
        train_fn_per_worker,
        train_loop_config=loop_config,
        datasets=datasets,
        dataset_config=DataConfig(datasets_to_split=["train"]),
        scaling_config=ScalingConfig(
            num_workers=(plan.num_workers, plan.max_workers) if plan.max_workers else plan.num_workers,
            elastic_resize_monitor_interval_s=cfg.scaling.elastic_resize_interval_s,
            use_gpu=plan.use_gpu,
            resources_per_worker=plan.resources_per_worker,
            accelerator_type=cfg.scaling.accelerator_type or None,
        ),
        run_config=RayRunConfig(
            name=cfg.run.name,
            storage_path=store.base if store else cfg.storage_path,
            storage_filesystem=store.fs if store else None,
            failure_config=FailureConfig(max_failures=cfg.failure.max_failures),
            logging_config=LoggingConfig(log_level="WARNING"),
            callbacks=[] if local_mode else [_history_callback(history_path), *(callbacks or [])],
            worker_runtime_env=worker_runtime_env(cfg),
        ),
    )
    try:
        result = trainer.fit()
        if result.error is not None:
            raise result.error
    except Exception as exc:  # TrainingFailedError and friends: the training itself failed
        finish_tracking(cfg, mlflow_run_id, None, failed=True)
        if _explained(exc):  # its message says it all: no traceback
            raise TrainingFailed(_first_line(exc)) from None
        raise TrainingFailed(_first_line(exc)) from exc
    ended = result.return_value or {}
    if ended.get("stopped") == "nan":
        from rayjobs.checkpoint import latest_complete, list_bucket_checkpoints

        if store is not None:
            good_path = next((c.path for c in reversed(list_bucket_checkpoints(store)) if c.complete), None)
        else:
            good = latest_complete(run_dir, warn=False)
            good_path = good.path if good else None
        ranks = ", ".join(map(str, ended["ranks"]))
        raise TrainingFailed(
            f"non-finite loss at step {ended['step']} on rank(s) {ranks}; every rank "
            f"stopped at that step; last good checkpoint: {good_path or 'none'}. Try a lower optim.lr, "
            f"optim.grad_clip, or training.nan_policy=skip"
        )
    metrics = {k: v for k, v in (result.metrics or {}).items() if isinstance(v, (int, float))}
    summary = {
        "run_name": cfg.run.name,
        "storage_path": run_dir,
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
        "checkpoint_uri": None,
        "mlflow_run_id": None,
        "wall_s": round(time.time() - started, 2),
        "samples_per_s": metrics.get("train/samples_per_s"),
        "num_workers": plan.num_workers,
        "device": "gpu" if plan.use_gpu else "cpu",
        "metrics": metrics,
        "history": history_path,
    }
    if store is not None and summary["checkpoint"]:
        summary["checkpoint_uri"], summary["checkpoint"] = fetch_final(store, run_dir, summary["checkpoint"])
    if cfg.tracking.enabled:
        summary["mlflow_run_id"] = finish_tracking(cfg, mlflow_run_id, summary, final=final)
    return summary


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
    from rayjobs.object_store import RunStore

    store = RunStore(cfg.storage_uri, cfg.run.name)
    store.check()  # before Ray starts: a wrong endpoint or missing credentials fail here, in one line
    return store


def fetch_final(store: Any, run_dir: str, reported: str) -> tuple[str, str]:
    """(its URL, a local copy) of the final checkpoint Ray reported in the bucket: the driver logs the local copy."""
    name = os.path.basename(reported.rstrip("/"))
    local = os.path.join(run_dir, name)
    problem = store.fetch(name, Path(local))
    if problem:
        raise TrainingFailed(f"the final checkpoint {store.url(name)} does not match its manifest: {problem}")
    return store.url(name), local


def start_tracking(cfg: RunConfig, plan: ScalingPlan, extra_tags: dict[str, str] | None = None) -> str | None:
    """Find or create the run's MLflow run and log its params and tags; None (one warning) if MLflow is away."""
    from rayjobs import tracking

    try:
        nodes = 1
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        tags = {
            **tracking.run_tags(cfg, plan.world_size, "gpu" if plan.use_gpu else "cpu", nodes),
            **(extra_tags or {}),
        }
        run_id = tracking.find_or_create_run(cfg, cfg.run_dir, tags)
        tracking.log_params_once(tracking.tracking_uri(cfg), run_id, tracking.flatten(cfg.model_dump(mode="json")))
        return run_id
    except Exception as exc:  # noqa: BLE001 - tracking never stops training
        print(
            f"[rayjobs] warning: MLflow at {tracking.tracking_uri(cfg)} is unavailable ({type(exc).__name__}); "
            "training goes on and rank 0 spools its metrics until it is back",
            flush=True,
        )
        return None


def finish_tracking(
    cfg: RunConfig,
    run_id: str | None,
    summary: dict[str, Any] | None,
    failed: bool = False,
    wait_s: float = 90.0,
    final: bool = True,
) -> str | None:
    """Replay anything spooled, log the end-of-run artifacts and model, end the MLflow run."""
    from rayjobs import tracking

    spool = os.path.join(cfg.run_dir, ".mlflow-spool.jsonl")
    deadline = time.time() + wait_s
    while True:
        try:
            run_id = run_id or tracking.find_or_create_run(cfg, cfg.run_dir)
            replay = tracking.has_pending(spool)
            if replay and not tracking.MetricsLogger(cfg, run_id, cfg.run_dir, spool).close(30):
                raise ConnectionError("spool not replayed")
            if failed:
                tracking.client(tracking.tracking_uri(cfg)).set_terminated(run_id, "FAILED")
            elif final:
                tracking.log_final(cfg, run_id, summary or {}, read_history(os.path.join(cfg.run_dir, "metrics.jsonl")))
            return run_id
        except Exception as exc:  # noqa: BLE001
            if failed or time.time() > deadline:
                print(
                    f"[rayjobs] warning: could not finish the MLflow run ({type(exc).__name__}: {exc}); "
                    f"spooled metrics (if any) stay in {spool} for the next run with this run.name",
                    flush=True,
                )
                return run_id
            time.sleep(3)


def _explained(exc: BaseException) -> bool:
    from rayjobs.errors import ExplainedFailure

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
    keys = ["train/loss", "val/loss", "val/accuracy", "test/loss", "test/accuracy"]
    shown = "  ".join(f"{k} {m[k]:.4f}" for k in keys if k in m)
    workers = summary["num_workers"] or "local mode, 1"
    lines = [
        f"rayjobs: run {summary['run_name']} finished in {summary['wall_s']:.1f} s "
        f"({workers} worker(s), {summary['device']}, {m.get('step', 0):.0f} steps)",
        f"  {shown}",
        f"  throughput: {summary['samples_per_s'] or 0:.0f} samples/s",
        f"  results:    {summary['storage_path']}",
        f"  checkpoint: {summary['checkpoint']}",
    ]
    if summary.get("checkpoint_uri"):
        lines.append(f"  in bucket:  {summary['checkpoint_uri']}")
    return "\n".join(lines)


def write_summary(summary: dict[str, Any], path: str) -> None:
    """Write the run summary as JSON (keys: run_name, storage_path, checkpoint, mlflow_run_id,
    wall_s, samples_per_s, metrics)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m rayjobs.train``: the same as ``rayjobs train``."""
    from rayjobs.cli import main as cli_main

    cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
