"""Hyperparameter search: Ray Tune around the very same training run.

    rayjobs tune --config rayjobs/configs/tune-digits.yaml [--set ...] [--summary PATH] [--resume]
    python -m rayjobs.tune --config rayjobs/configs/tune-digits.yaml

Each trial is a Tune function trainable that *is* the Train driver (``rayjobs.train.run``:
``TorchTrainer`` inside, with ``TuneReportCallback``), as Ray Train V2 intends. A trial's Train
run name is its trial id, so a restarted trial resumes from its own checkpoints. MLflow: one
parent run for the search, one child run per trial (``mlflow.parentRunId``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rayjobs import log
from rayjobs.config import SPACE_KINDS, RunConfig, from_dict, set_by_path
from rayjobs.errors import ConfigError, Interrupted, TrainingFailed
from rayjobs.plan import ScalingPlan
from rayjobs.rundir import RunDir

POINTER = "pointer.json"  # a Tune checkpoint (PBT) names the Train checkpoint it stands for


# ---------------------------------------------------------------------------------------------
# The search space: validated before Ray starts, then turned into Tune domains.


def _numbers(values: Any, n: int) -> bool:
    return (
        isinstance(values, list)
        and len(values) == n
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    )


# What the search sets for every trial, whatever the space says (trial_driver, and the store it pins).
SET_FOR_EACH_TRIAL = {
    "run.name": "each trial is named by its trial id",
    "run.storage_path": "trials live under the search's own directory",
    "run.local_dir": "trials live under the search's own directory",
    "tracking.enabled": "the search and its trials log to MLflow together, or none does",
    "tracking.uri": "every trial logs to the search's MLflow store, under its parent run",
    "tracking.run_name": "each trial's MLflow run is named <search>-<trial id>",
    "tracking.register_as": "a trial registers no model",
    "checkpoint.every_steps": "a trial checkpoints at each eval, training.eval_every",
    "checkpoint.every_epochs": "a trial checkpoints at each eval, training.eval_every",
}


def space_problems(cfg: RunConfig) -> list[str]:
    """One line per problem in ``tune.space`` (paths, kinds, bounds, value types)."""
    problems = []
    if cfg.storage_uri:
        problems.append(
            f"run.storage_path: {cfg.storage_uri}: a search needs a filesystem path (its trials share Tune's "
            "experiment directory); object store URIs work with `rayjobs train` only: mount the bucket and give its path"
        )
    base = cfg.model_dump(mode="json", by_alias=True)
    if cfg.tracking.enabled and not cfg.tracking.uri:  # trials live elsewhere: pin the search's own store
        from rayjobs.tracking import tracking_uri

        base["tracking"]["uri"] = tracking_uri(cfg)
    for path, spec in cfg.tune.space.items():
        where = f"tune.space.{path}"
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in SPACE_KINDS:
            problems.append(
                f"{where}: must be one mapping {{kind: values}} with kind one of {', '.join(SPACE_KINDS)}, got {spec!r}"
            )
            continue
        if path == "tune" or path.startswith("tune."):  # read once by the search, never by a trial
            problems.append(f"{where}: the search's own settings cannot be searched; set {path} once")
            continue
        owned = [why for key, why in SET_FOR_EACH_TRIAL.items() if key == path or key.startswith(f"{path}.")]
        if owned:  # trial_driver overwrites them: the search would have run the same trials without a word
            problems.append(f"{where}: the search sets it for each trial ({owned[0]}); remove it from tune.space")
            continue
        kind, values = next(iter(spec.items()))
        if kind in ("choice", "grid"):
            if not isinstance(values, list) or not values:
                problems.append(f"{where}: {kind} needs a non-empty list, got {values!r}")
                continue
            samples = values
        elif kind == "quniform":
            if not _numbers(values, 3) or values[0] >= values[1] or values[2] <= 0:
                problems.append(f"{where}: quniform needs [low, high, q] with low < high and q > 0, got {values!r}")
                continue
            low, high, q = values
            if not all(math.isclose(b / q, round(b / q)) for b in (low, high)):  # Ray's own rule, a traceback there
                problems.append(
                    f"{where}: quniform's low and high must be multiples of q (each draw is), got {values!r}"
                )
                continue
            samples = [low, high, low + q]  # low + q: a fractional q over an integer field
        else:
            if not _numbers(values, 2):
                problems.append(f"{where}: {kind} needs [low, high] (two numbers), got {values!r}")
                continue
            if values[0] >= values[1]:
                problems.append(f"{where}: low must be < high, got {values!r}")
                continue
            if kind == "loguniform" and values[0] <= 0:
                problems.append(f"{where}: loguniform needs low > 0, got {values!r}")
                continue
            samples = values
        if kind == "grid" and cfg.tune.search == "optuna":
            problems.append(f"{where}: grid works with tune.search=random only; use choice with optuna")
        for value in samples:
            try:
                from_dict(_with_value(base, path, value))
            except ConfigError as exc:
                detail = "; ".join(exc.problems)
                problems.append(f"{where}: value {value!r} does not fit the config: {detail}")
                break
    if not cfg.tune.space:  # every trial would train the same config with the same seed
        problems.append(
            "tune.space: empty: a search needs at least one hyperparameter to vary, e.g. "
            "--set 'tune.space={optim.lr: {loguniform: [0.0005, 0.02]}}' (or --config tune-digits)"
        )
    return problems


def _with_value(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of the config ``base`` (a dict) with ``path`` set to one value of the space."""
    trial = json.loads(json.dumps(base))
    set_by_path(trial, path, value)
    return trial


# A randint over a model's argument is built at each of its integers up to this many (a few ms each);
# a wider one at the two it can draw at its ends.
RANDINT_BUILDS = 64


def check_model_choices(cfg: RunConfig) -> None:
    """Each value a ``choice``, ``grid`` or ``randint`` gives a registered model's arguments must build
    it, on the meta device as the base config is: ``{model.kwargs.n_heads: {choice: [3, 4]}}`` (or
    ``{randint: [1, 9]}``) over gpt's width of 32 failed the trials that drew 3, in their workers
    (``space_problems`` checks types and bounds). A continuous range is left to those bounds."""
    from rayjobs import preflight

    base = cfg.model_dump(mode="json", by_alias=True)
    for path, spec in cfg.tune.space.items():
        kind, values = next(iter(spec.items()))
        if not path.startswith("model.") or kind not in ("choice", "grid", "randint"):
            continue
        if kind == "randint":  # its upper bound is never drawn
            low, high = int(values[0]), int(values[1])
            values = list(range(low, high)) if high - low <= RANDINT_BUILDS else [low, high - 1]
        for value in values:
            try:
                preflight.check_model_builds(from_dict(_with_value(base, path, value)))
            except ConfigError as exc:
                raise ConfigError(f"tune.space.{path}: value {value!r}: {exc}") from None


def scheduler_problems(cfg: RunConfig) -> list[str]:
    """The scheduler's first decision must come before the end of a trial: ASHA's first rung
    (before ``tune.max_t`` or the run's length), PBT's first exploit; PBT makes its own trials."""
    t = cfg.tune
    if t.scheduler == "fifo":
        return []
    length = _run_length(cfg) if t.time_attr == "step" else cfg.training.epochs
    if t.scheduler == "asha" and t.grace_period > (t.max_t or length):
        end = f"tune.max_t={t.max_t}" if t.max_t else f"the run's length, {length} {t.time_attr}s"
        fix = f"set it to at most {t.max_t or length}" + (
            "" if t.max_t else ", or lengthen the trials (training.epochs)"
        )
        return [f"tune.grace_period: {t.grace_period} is past the end of a trial ({end}); {fix}"]
    if t.scheduler == "pbt" and t.search != "random":
        return [f"tune.search: {t.search} cannot drive tune.scheduler=pbt (PBT makes its own trials); use random"]
    if t.scheduler == "pbt" and t.perturbation_interval >= length:
        return [
            f"tune.perturbation_interval: {t.perturbation_interval} {t.time_attr}s leaves no exploit before the end of "
            f"a trial ({length} {t.time_attr}s); set it below {length}, or lengthen the trials (training.epochs)"
        ]
    return []


def _batch_sizes(cfg: RunConfig) -> list[int]:
    """The batch sizes the trials may take: the config's, or the space's (a range: its largest)."""
    spec = cfg.tune.space.get("training.batch_size")
    if not spec:
        return [cfg.training.batch_size]
    kind, values = next(iter(spec.items()))
    if kind in ("choice", "grid"):
        return [int(v) for v in values]
    return [int(values[1]) - 1 if kind == "randint" else int(values[1])]  # randint's upper bound is exclusive


def tune_domain(spec: dict[str, Any]) -> Any:
    """The Ray Tune domain for one validated space entry."""
    from ray import tune

    kind, v = next(iter(spec.items()))
    return {
        "choice": lambda: tune.choice(v),
        "grid": lambda: tune.grid_search(v),
        "uniform": lambda: tune.uniform(v[0], v[1]),
        "loguniform": lambda: tune.loguniform(v[0], v[1]),
        "randint": lambda: tune.randint(int(v[0]), int(v[1])),
        "quniform": lambda: tune.quniform(v[0], v[1], v[2]),
    }[kind]()


def trial_config(base: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The base config with a trial's sampled values set at their dotted paths."""
    cfg = json.loads(json.dumps(base))
    for path, value in params.items():
        set_by_path(cfg, path, value)
    return cfg


# ---------------------------------------------------------------------------------------------
# The trial: a Tune function trainable that is the Train driver.


def trial_driver(params: dict[str, Any], base: dict[str, Any], layout: dict[str, Any]) -> None:
    """Run one trial: the training run with this trial's values, reporting to Tune as it goes."""
    import ray.tune

    from rayjobs import train

    trial_id = ray.tune.get_context().get_trial_id()
    raw = trial_config(base, params)
    raw["run"].update(name=trial_id, storage_path=layout["train_storage"])
    RunDir(os.path.join(layout["train_storage"], trial_id)).record_event("trial_start", pid=os.getpid())
    raw["tracking"].update(register_as="", run_name=f"{layout['name']}-{trial_id}")
    # Every report carries the search metric: checkpoints are taken exactly at the evals.
    evals = raw["training"]["eval_every"]
    raw["checkpoint"].update(every_steps=evals, every_epochs=0 if evals else 1)
    tags = {"mlflow.parentRunId": layout["parent_run_id"], "ray.trial_id": trial_id} if layout["parent_run_id"] else {}
    if layout["scheduler"] == "pbt":
        raw["checkpoint"]["keep_last"] = 10_000  # a donor's checkpoint must outlive the exploits that load it
        _pbt_segments(raw, tags, layout, trial_id)
        return
    from ray.tune.integration.ray_train import TuneReportCallback

    cfg = from_dict(raw)
    try:
        train.run(cfg, callbacks=[TuneReportCallback()], mlflow_tags=tags)
    except TrainingFailed as exc:
        raise RuntimeError(f"trial {trial_id} failed: {exc}") from exc


def _pbt_segments(raw: dict[str, Any], tags: dict[str, str], layout: dict[str, Any], trial_id: str) -> None:
    """PBT under Train V2: train in segments; each ends with a Tune checkpoint that points at the Train one.

    An exploit restarts this function with another trial's pointer and perturbed values: the
    first segment then resumes from that checkpoint (``checkpoint.resume_from``).
    """
    import ray.tune

    from rayjobs import train

    interval = layout["perturbation_interval"]
    restored = ray.tune.get_checkpoint()
    start_from, step = None, 0
    if restored is not None:
        with restored.as_directory() as d:
            pointer = json.loads(Path(d, POINTER).read_text())
        start_from, step = pointer["path"], pointer["step"]
        if pointer["trial_id"] != trial_id:
            _record_exploit(layout, trial_id, pointer, raw)
    while True:
        seg = json.loads(json.dumps(raw))
        if start_from:
            seg["checkpoint"]["resume_from"] = start_from
        cfg = from_dict(seg)
        summary = train.run(cfg, mlflow_tags=tags, stop_at_step=step + interval, final=False, exploit=bool(start_from))
        step, start_from = int(summary["metrics"]["step"]), None
        with tempfile.TemporaryDirectory() as d:
            Path(d, POINTER).write_text(json.dumps({"path": summary["checkpoint"], "trial_id": trial_id, "step": step}))
            metrics = {k: v for k, v in summary["metrics"].items() if isinstance(v, (int, float))}
            ray.tune.report(metrics, checkpoint=ray.tune.Checkpoint.from_directory(d))
        if step >= _run_length(cfg):
            from rayjobs.train import finish_tracking

            finish_tracking(cfg, summary["mlflow_run_id"], summary)
            return


def _record_exploit(layout: dict[str, Any], trial_id: str, pointer: dict[str, Any], raw: dict[str, Any]) -> None:
    event = {
        "trial_id": trial_id,
        "cloned_from": pointer["trial_id"],
        "step": pointer["step"],
        "checkpoint": pointer["path"],
        "time": time.time(),
    }
    RunDir(os.path.join(layout["train_storage"], trial_id)).record_exploit(event)
    log.log(f"pbt: trial {trial_id} exploits {pointer['trial_id']} at step {pointer['step']}")
    if layout["parent_run_id"]:
        try:
            from rayjobs import tracking

            cfg = from_dict(raw)
            tracker = tracking.Tracker(cfg)
            run_id = tracker.open(os.path.join(layout["train_storage"], trial_id))
            tracker.tag(
                run_id, f"rayjobs.pbt.exploit.step{pointer['step']}", f"cloned from trial {pointer['trial_id']}"
            )
        except Exception:  # noqa: BLE001 - tracking never stops training
            pass


def _steps_per_epoch(cfg: RunConfig) -> int:
    from rayjobs import data as data_lib

    return max(1, data_lib.train_rows(cfg.data.name, cfg.data.kwargs) // cfg.training.batch_size)


def _run_length(cfg: RunConfig) -> int:
    """Optimizer steps of one full trial (as the loop counts them)."""
    total = _steps_per_epoch(cfg) * cfg.training.epochs
    return min(total, cfg.training.max_steps) if cfg.training.max_steps else total


# ---------------------------------------------------------------------------------------------
# The search driver.


def layout_for(cfg: RunConfig) -> dict[str, Any]:
    """Names and places of a search: Tune's experiment dir, the trials' Train storage."""
    name = cfg.tune.name or f"tune-{cfg.run.name}"
    return {
        "name": name,
        "experiment_dir": os.path.join(cfg.storage_path, name),
        "train_storage": os.path.join(cfg.storage_path, f"{name}-trials"),
        "scheduler": cfg.tune.scheduler,
        "perturbation_interval": 0,
        "parent_run_id": None,
    }


def run_search(cfg: RunConfig, resume: bool = False) -> dict[str, Any]:
    """Run (or resume) the search and return its summary."""
    from rayjobs import paths, preflight

    for note in paths.resolve(cfg):
        log.note(note)
    problems = space_problems(cfg) + preflight.missing_packages(cfg)
    if cfg.scaling.num_workers == 0:
        problems.append("scaling.num_workers: a search needs workers (each trial runs a TorchTrainer); use 1 or more")
    if problems:
        raise ConfigError(problems)
    from rayjobs import launch

    launch.poll_reports_often()  # the trials' drivers inherit it; a bad value is one line before Ray
    preflight.check_optimizer(cfg)
    source = preflight.check_data(cfg)
    preflight.check_model_builds(cfg)  # the data's shapes size it; the parallel checks build it too
    check_model_choices(cfg)
    plan = launch.plan_scaling(cfg, launch.cluster_gpu_count())
    field = "tune.space.training.batch_size" if "training.batch_size" in cfg.tune.space else "training.batch_size"
    for batch_size in _batch_sizes(cfg):  # every batch a trial may take must fit the training split
        preflight.check_train_rows(cfg, source, plan.world_size, batch_size, field)
    problems = scheduler_problems(cfg)  # measured in steps: a batch that fits first
    if problems:
        raise ConfigError(problems)
    layout = layout_for(cfg)
    if resume and not os.path.isdir(layout["experiment_dir"]):
        raise ConfigError(
            f"--resume: no search to resume at {layout['experiment_dir']}; the same command without --resume starts it"
        )
    preflight.check_writable_dir(layout["train_storage"])
    preflight.check_writable_dir(layout["experiment_dir"])
    keep_search_config(cfg, layout, resume)

    from ray import tune

    started = time.time()
    launch.init_ray(plan, driver_cpus=cfg.tune.trial_cpus)  # a local Ray fits one trial at least
    steps = _run_length(cfg)
    layout["perturbation_interval"] = _interval(cfg, steps)
    parent = _start_parent(cfg, layout) if cfg.tracking.enabled else None
    layout["parent_run_id"] = parent
    base = cfg.model_dump(mode="json", by_alias=True)
    if cfg.tracking.enabled and not cfg.tracking.uri:  # trials live elsewhere: pin the search's own store
        from rayjobs.tracking import tracking_uri

        base["tracking"]["uri"] = tracking_uri(cfg)
    trial_resources = _trial_resources(cfg)
    trainable = tune.with_resources(tune.with_parameters(trial_driver, base=base, layout=layout), trial_resources)
    tuner = _tuner(cfg, layout, trainable, _max_concurrent(cfg, plan, trial_resources), steps, resume)
    before = _live_placement_groups()
    with _a_stop_signal_stops_tune() as interrupted, _no_tensorboard_logs():
        results = tuner.fit()
    summary = _summarize(cfg, layout, results, steps, started, interrupted.is_set())
    if interrupted.is_set():
        if cfg.tracking.enabled and parent:
            _end_interrupted(cfg, layout, summary)
        raise Interrupted(
            f"search {layout['name']} interrupted; its state is saved in {layout['experiment_dir']}: the same "
            "command with --resume continues it"
        )
    errors = [r.error for r in results if r.error is not None]
    if summary["trials"] and len(errors) == len(summary["trials"]):
        first = str(errors[0]).strip().splitlines()
        summary["failed"] = (
            f"all {len(errors)} trials failed; the first: {first[-1] if first else type(errors[0]).__name__}"
        )
    if cfg.tracking.enabled and parent:
        _finish_parent(cfg, layout, summary)
    summary["placement_groups_left"] = len(_placement_groups_left(before))
    if summary.get("failed"):
        raise TrainingFailed(f"search {layout['name']}: {summary['failed']}")
    return summary


SEARCH_CONFIG = "rayjobs-search.json"  # in the experiment directory: the config a search started with
CHANGEABLE_ON_RESUME = ("tune.max_concurrent_trials",)


def keep_search_config(cfg: RunConfig, layout: dict[str, Any], resume: bool) -> None:
    """Record the config a search starts with; a ``--resume`` with another one is refused.

    Tune restores a search's trials, samples and scheduler state as they were saved, and new
    trials would train with the new base config: a changed space, sample count or training
    setting would be ignored or mixed in without a word.
    """
    from rayjobs.tracking import flatten

    path = Path(layout["experiment_dir"], SEARCH_CONFIG)
    current = flatten(cfg.model_dump(mode="json", by_alias=True))
    if resume and path.is_file():
        saved = json.loads(path.read_text())
        changed = [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
        changed = [k for k in changed if k not in CHANGEABLE_ON_RESUME]
        if changed:
            shown = "; ".join(f"{k} {saved.get(k, '(unset)')} -> {current.get(k, '(unset)')}" for k in changed[:3])
            more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
            raise ConfigError(
                f"--resume: search {layout['name']} started with another config: {shown}{more}; resume it with the "
                "settings it started with, or drop --resume and give a new tune.name"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(current, indent=1, sort_keys=True))


def _tuner(
    cfg: RunConfig, layout: dict[str, Any], trainable: Any, max_concurrent: int, steps: int, resume: bool
) -> Any:
    """A new ``Tuner`` for the search, or the saved one restored (``--resume``: unfinished and errored trials go on)."""
    from ray import tune

    from rayjobs.tune_progress import ProgressTable

    if resume:
        if not tune.Tuner.can_restore(layout["experiment_dir"]):
            raise ConfigError(f"--resume: {layout['experiment_dir']} holds no restorable Tune experiment")
        return tune.Tuner.restore(
            layout["experiment_dir"], trainable=trainable, resume_unfinished=True, resume_errored=True
        )
    return tune.Tuner(
        trainable,
        param_space={path: tune_domain(spec) for path, spec in cfg.tune.space.items()},
        tune_config=tune.TuneConfig(
            metric=cfg.tune.metric,
            mode=cfg.tune.mode,
            num_samples=cfg.tune.num_samples,
            search_alg=_search_alg(cfg, max_concurrent),
            scheduler=_scheduler(cfg, steps, layout),
            time_budget_s=cfg.tune.time_budget_s or None,
            reuse_actors=reuses_trial_drivers(cfg),
        ),
        run_config=tune.RunConfig(
            name=layout["name"],
            storage_path=cfg.storage_path,
            verbose=0,
            # A trial whose Train run failed (a controller that died, a lost node) is retried:
            # it resumes from its own checkpoints, so a retry costs only the lost steps.
            failure_config=tune.FailureConfig(max_failures=cfg.tune.max_failures),
            callbacks=[
                ProgressTable(cfg.tune.metric, cfg.tune.mode, list(cfg.tune.space)),
                *_tune_file_loggers(),  # Tune's own, less TensorBoard's (see _no_tensorboard_logs)
            ],
        ),
    )


def reuses_trial_drivers(cfg: RunConfig) -> bool:
    """Whether a finished trial's driver process runs the next trial (Tune's ``reuse_actors``): its
    imports are done, so a trial reaches its first step 1.6 s sooner here (5.7 s against 7.3 s).

    Only where no trial is stopped while it runs (FIFO, no time budget): Tune hands a stopped
    trial's actor to the next trial once the trial's function has returned, within 2 s, and a
    function still inside its Train ``fit()`` does not, so that next trial failed ("Could not
    re-use actor").
    """
    return cfg.tune.scheduler == "fifo" and not cfg.tune.time_budget_s


@contextlib.contextmanager
def _a_stop_signal_stops_tune() -> Iterator[threading.Event]:
    """Ctrl-C or SIGTERM to the driver (``ray job stop``, a pod's end) during ``Tuner.fit``: Tune's own
    graceful stop (the experiment state saved once more, which SIGUSR1 asks for too), and an event set
    that the driver reads after ``fit`` returns. Tune's SIGINT handler would stop it the same way but
    leave no trace of why it stopped; Ray's SIGTERM handler ended the driver with no word, the search's
    MLflow runs left RUNNING."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
        yield interrupted
        return

    def on_stop(signum: int, frame: Any) -> None:
        if interrupted.is_set():  # a second one: stop now
            raise KeyboardInterrupt
        interrupted.set()
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = {sig: signal.signal(sig, on_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous_env = os.environ.get(TUNE_SIGINT_VARIABLE)
    os.environ[TUNE_SIGINT_VARIABLE] = "1"
    try:
        yield interrupted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if previous_env is None:
            os.environ.pop(TUNE_SIGINT_VARIABLE, None)
        else:
            os.environ[TUNE_SIGINT_VARIABLE] = previous_env


TUNE_SIGINT_VARIABLE = "TUNE_DISABLE_SIGINT_HANDLER"  # Tune then leaves SIGINT to us (SIGUSR1 stays its)
TUNE_AUTO_LOGGERS_VARIABLE = "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"  # read by Tuner.fit


def _tune_file_loggers() -> list[Any]:
    """Tune's per-trial result files (progress.csv, result.json), which it adds itself unless told not to."""
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    return [CSVLoggerCallback(), JsonLoggerCallback()]


@contextlib.contextmanager
def _no_tensorboard_logs() -> Iterator[None]:
    """``Tuner.fit`` without the TensorBoard logger Tune adds by itself: a search's metrics are in MLflow,
    importing tensorboardX took 1.2 s of the driver's CPU at every search's start, and Tune printed
    a `tensorboard --logdir` hint for a tool rayjobs does not install. (CSV and JSON stay: they are
    passed to the Tuner.) A value of the variable you set is kept."""
    previous = os.environ.get(TUNE_AUTO_LOGGERS_VARIABLE)
    os.environ.setdefault(TUNE_AUTO_LOGGERS_VARIABLE, "1")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(TUNE_AUTO_LOGGERS_VARIABLE, None)


def _end_interrupted(cfg: RunConfig, layout: dict[str, Any], summary: dict[str, Any]) -> None:
    """An interrupted search's MLflow runs: the unfinished trials and the parent end KILLED (resumable)."""
    from rayjobs import tracking

    tracker = tracking.Tracker(cfg)
    for t in summary["trials"]:
        if not t["mlflow_run_id"]:
            continue
        end = _trial_run_end(t["status"], tracker.client.get_run(t["mlflow_run_id"]).info.status, interrupted=True)
        if end:
            tracker.end(t["mlflow_run_id"], end)
    tracker.end(layout["parent_run_id"], "KILLED")


def _trial_run_end(tune_status: str, mlflow_status: str, interrupted: bool) -> str | None:
    """How a trial's MLflow run must end, by Tune's word on the trial; None: leave it as it is.

    A trial Tune stopped (early, or with the whole search) may have ended its own run FAILED as it
    was torn down (its Train run raised on the way out): that run ends KILLED.
    """
    if tune_status in ("stopped early", "interrupted") and mlflow_status in ("RUNNING", "FAILED"):
        return "KILLED"
    if mlflow_status == "RUNNING":
        return "KILLED" if interrupted else "FAILED"
    return None


def _live_placement_groups() -> set[str]:
    import ray

    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg.get("state") != "REMOVED"}


def _placement_groups_left(before: set[str], wait_s: float = 30.0) -> set[str]:
    """The search's placement groups still held, after giving Ray time to free them.

    A trial stopped early is killed with its Train controller; Train's detached cleaner notices
    the dead controller (it polls every second) and only then removes the workers' group. Groups
    that were alive before the search (another job's) are not the search's to count.
    """
    deadline = time.monotonic() + wait_s
    while True:
        left = _live_placement_groups() - before
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _interval(cfg: RunConfig, steps: int) -> int:
    if cfg.tune.perturbation_interval:
        return cfg.tune.perturbation_interval * (_steps_per_epoch(cfg) if cfg.tune.time_attr == "epoch" else 1)
    return cfg.training.eval_every or _steps_per_epoch(cfg)


def _trial_resources(cfg: RunConfig) -> dict[str, float]:
    """The trial actor only drives its TorchTrainer; the workers reserve their own resources."""
    return {"CPU": cfg.tune.trial_cpus}


def _max_concurrent(cfg: RunConfig, plan: ScalingPlan, trial_resources: dict[str, float]) -> int:
    """``auto``: cluster CPUs divided by what one trial takes (its driver plus its workers)."""
    if cfg.tune.max_concurrent_trials != "auto":
        return int(cfg.tune.max_concurrent_trials)
    import ray

    total = ray.cluster_resources().get("CPU", 1.0)
    workers = max(plan.num_workers, plan.max_workers)  # an elastic trial may grow to its maximum
    per_trial = trial_resources["CPU"] + workers * plan.cpus_per_worker
    return max(1, int(total // per_trial))


def _search_alg(cfg: RunConfig, max_concurrent: int) -> Any:
    """The searcher, seeded from ``training.seed``: the same seed samples the same trial configs."""
    from ray.tune.search import ConcurrencyLimiter

    if cfg.tune.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return ConcurrencyLimiter(OptunaSearch(seed=cfg.training.seed), max_concurrent=max_concurrent)
    from ray.tune.search.basic_variant import BasicVariantGenerator

    return BasicVariantGenerator(max_concurrent=max_concurrent, random_state=cfg.training.seed)


def _scheduler(cfg: RunConfig, steps: int, layout: dict[str, Any]) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    t = cfg.tune
    if t.scheduler == "asha":
        full = steps if t.time_attr == "step" else cfg.training.epochs
        # One past the end: ASHA would otherwise stop a trial at its last report, killing the
        # trial actor before it logs its model and ends its MLflow run.
        return ASHAScheduler(
            time_attr=t.time_attr,
            max_t=(t.max_t or full) + 1,
            grace_period=t.grace_period,
            reduction_factor=t.reduction_factor,
        )
    if t.scheduler == "pbt":
        return PopulationBasedTraining(
            time_attr="step",
            perturbation_interval=layout["perturbation_interval"],
            # A grid sets the starting population; mutations then draw from its values.
            hyperparam_mutations={
                p: tune_domain({"choice": s["grid"]} if "grid" in s else s) for p, s in t.space.items()
            },
            quantile_fraction=0.5,
            resample_probability=0.5,
        )
    return FIFOScheduler()


def _start_parent(cfg: RunConfig, layout: dict[str, Any]) -> str | None:
    from rayjobs import tracking

    try:
        tags = {"rayjobs.kind": "tune", "tune.scheduler": cfg.tune.scheduler, "tune.search": cfg.tune.search}
        tracker = tracking.Tracker(cfg)
        run_id = tracker.open(layout["experiment_dir"], tags, run_name=layout["name"])
        space = {f"tune.space.{k}": json.dumps(v) for k, v in cfg.tune.space.items()}
        tracker.log_params(
            run_id,
            {
                **space,
                "tune.num_samples": str(cfg.tune.num_samples),
                "tune.metric": cfg.tune.metric,
                "tune.mode": cfg.tune.mode,
                "tune.scheduler": cfg.tune.scheduler,
                "tune.search": cfg.tune.search,
            },
        )
        return run_id
    except Exception as exc:  # noqa: BLE001 - tracking never stops the search
        log.warn(f"MLflow unavailable for the search's parent run ({type(exc).__name__})")
        return None


def _summarize(
    cfg: RunConfig, layout: dict[str, Any], results: Any, steps: int, started: float, interrupted: bool = False
) -> dict[str, Any]:
    from rayjobs import tracking

    trials = []
    for r in results:
        metrics = {
            k: v for k, v in (r.metrics or {}).items() if isinstance(v, (int, float)) and ("/" in k or k == "step")
        }
        trial_id = (r.metrics or {}).get("trial_id")  # Tune adds it to every result
        run_dir = os.path.join(layout["train_storage"], str(trial_id))
        exploits = RunDir(run_dir).read_exploits()
        last_step = int(metrics.get("step", 0))
        status = "error" if r.error else ("done" if last_step >= steps else "stopped early")
        if interrupted and status == "stopped early":
            status = "interrupted"
        run_id = None
        if cfg.tracking.enabled:
            try:
                run_id = tracking.Tracker(cfg).find(run_dir) if os.path.isdir(run_dir) else None
            except Exception:  # noqa: BLE001
                run_id = None
        history = RunDir(run_dir).read_history()
        starts, first_steps = RunDir(run_dir).read_events("trial_start"), RunDir(run_dir).read_events("first_step")
        trials.append(
            {
                "id": trial_id,
                "status": status,
                "config": {k: v for k, v in (r.config or {}).items()},
                "metrics": metrics,
                "mlflow_run_id": run_id,
                "exploits": exploits,
                "steps": last_step,
                "history": [h for h in history if cfg.tune.metric in h],
                # Fixed cost of a trial: its driver's start to its first optimizer step.
                "start_to_first_step_s": (
                    round(first_steps[0]["time"] - starts[0]["time"], 2) if starts and first_steps else None
                ),
            }
        )
    try:
        best = results.get_best_result(metric=cfg.tune.metric, mode=cfg.tune.mode, scope="all")
    except RuntimeError:  # no trial reported the metric (they all failed before their first eval)
        best = None
    best_id = (best.metrics or {}).get("trial_id") if best else None
    best_trial = next((t for t in trials if t["id"] == best_id), None)
    return {
        "name": layout["name"],
        "experiment_dir": layout["experiment_dir"],
        "best_config": dict(best.config or {}) if best else {},
        "best_metrics": {
            k: v for k, v in ((best.metrics or {}) if best else {}).items() if isinstance(v, (int, float)) and "/" in k
        },
        "best_trial": best_trial["id"] if best_trial else None,
        "mlflow_parent_run_id": layout["parent_run_id"],
        "trials": trials,
        "total_steps": sum(t["steps"] for t in trials),
        "wall_s": round(time.time() - started, 2),
    }


REGISTERED_TAG = "rayjobs.registered"  # name:version@model_uri of the best model this search registered


def _finish_parent(cfg: RunConfig, layout: dict[str, Any], summary: dict[str, Any]) -> None:
    """Tag the best child, end unfinished children, plots and best metrics on the parent, register the best model."""
    from mlflow.entities import Metric, Param

    from rayjobs import tracking

    tracker = tracking.Tracker(cfg)
    c = tracker.client  # reads; every change goes through the tracker
    parent = layout["parent_run_id"]
    failed = [t for t in summary["trials"] if t["status"] == "error"]
    if summary["trials"] and len(failed) == len(summary["trials"]):
        for t in failed:
            if t["mlflow_run_id"] and c.get_run(t["mlflow_run_id"]).info.status == "RUNNING":
                tracker.fail(t["mlflow_run_id"])
        tracker.fail(parent, summary["failed"])
        return
    for t in summary["trials"]:
        if not t["mlflow_run_id"]:
            continue
        end = _trial_run_end(t["status"], c.get_run(t["mlflow_run_id"]).info.status, interrupted=False)
        if end:
            tracker.end(t["mlflow_run_id"], end)
        tracker.tag(t["mlflow_run_id"], "rayjobs.tune.status", t["status"])
        if t["id"] == summary["best_trial"]:
            tracker.tag(t["mlflow_run_id"], "rayjobs.best", "true")
    now = int(time.time() * 1000)
    tracker.log_batch(
        parent,
        metrics=[Metric(f"best/{k}", float(v), now, 0) for k, v in summary["best_metrics"].items()],
        params=[
            Param(f"best.{k}", str(v))
            for k, v in summary["best_config"].items()
            if f"best.{k}" not in c.get_run(parent).data.params
        ],
    )
    with tempfile.TemporaryDirectory() as d:
        draw_search_plots(summary, cfg.tune.metric, Path(d))
        for png in Path(d).glob("*.png"):
            tracker.log_artifact(parent, str(png))
    best = next((t for t in summary["trials"] if t["id"] == summary["best_trial"]), None)
    if cfg.tracking.register_as:
        uri = (
            c.get_run(best["mlflow_run_id"]).data.tags.get(tracking.MODEL_URI_TAG)
            if best and best["mlflow_run_id"]
            else None
        )
        registered = c.get_run(parent).data.tags.get(REGISTERED_TAG)
        if uri and registered and registered.split("@", 1)[1] == uri:  # tune --resume of a finished search
            name, version = registered.split("@", 1)[0].rsplit(":", 1)
            summary["registered_model"] = {"name": name, "version": version}
        elif uri:
            name, version = tracker.register(uri, cfg.tracking.register_as)
            summary["registered_model"] = {"name": name, "version": version}
            tracker.tag(parent, REGISTERED_TAG, f"{name}:{version}@{uri}")
        else:
            why = "no best trial" if not best else f"trial {best['id']} ({best['status']}) logged no model"
            summary["registered_model"] = {"skipped": why}
            log.warn(f"best model not registered: {why}")
    tracker.end(parent, "FINISHED")


def draw_search_plots(summary: dict[str, Any], metric: str, out_dir: Path) -> None:
    """hyperparameters_vs_metric.png (one panel per numeric hyperparameter) and learning_curves.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = [t for t in summary["trials"] if metric in t["metrics"]]
    keys = sorted({k for t in trials for k, v in t["config"].items() if isinstance(v, (int, float))})
    if keys:
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.5), squeeze=False)
        for ax, key in zip(axes[0], keys):
            xs = [t["config"][key] for t in trials if key in t["config"]]
            ys = [t["metrics"][metric] for t in trials if key in t["config"]]
            ax.scatter(xs, ys)
            if xs and min(xs) > 0 and max(xs) / min(xs) > 20:
                ax.set_xscale("log")
            ax.set_xlabel(key)
            ax.set_ylabel(metric)
        fig.tight_layout()
        fig.savefig(out_dir / "hyperparameters_vs_metric.png", dpi=90)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    for t in summary["trials"]:
        pts = [(h["step"], h[metric]) for h in t["history"]]
        if pts:
            ax.plot(*zip(*pts), marker=".", label=f"{t['id']} ({t['status']})")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    if ax.get_lines():  # no trial reported the metric yet: an empty chart, no legend to warn about
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "learning_curves.png", dpi=90)
    plt.close(fig)


def format_summary(summary: dict[str, Any], metric: str) -> str:
    """The console summary: one line per trial, then the best config and metric."""
    lines = [
        f"rayjobs: search {summary['name']} finished in {summary['wall_s']:.1f} s ({len(summary['trials'])} trials)"
    ]
    for t in summary["trials"]:
        value = t["metrics"].get(metric)
        shown = f"{value:.4f}" if isinstance(value, (int, float)) else "-"
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in t["config"].items())
        lines.append(f"  {t['id']}  {t['status']:<13} step {t['steps']:>5}  {metric} {shown}  {params}")
    best = ", ".join(f"{k}={_fmt(v)}" for k, v in summary["best_config"].items())
    lines.append(f"  best: {best}  ->  {metric} {summary['best_metrics'].get(metric, float('nan')):.4f}")
    if summary.get("mlflow_parent_run_id"):
        lines.append(f"  MLflow parent run: {summary['mlflow_parent_run_id']}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) and not math.isnan(v) else str(v)


if __name__ == "__main__":  # ``python -m rayjobs.tune`` is ``rayjobs tune`` (what ``ray job submit`` runs)
    from rayjobs.cli import main

    main(["tune", *sys.argv[1:]])
