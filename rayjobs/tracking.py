"""MLflow lineage: the one place that creates runs, a batched asynchronous logger that spools to
disk while the server is away, and the artifacts logged at the end of a run.

    experiment -> run (one per training run; restarts and re-runs continue it, tag rayjobs.attempt)
               -> metrics keyed by global step (a replayed step is dropped, so curves never fork)

Only the driver and rank 0 talk to MLflow. The tracking URI and credentials reach the workers
through Ray's runtime environment (MLFLOW_TRACKING_URI, MLFLOW_TRACKING_USERNAME/PASSWORD).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rayjobs.config import redact  # one rule for params, tags, artifacts and checkpoints
from rayjobs.log import log
from rayjobs.rundir import mlflow_db

# Fail fast instead of MLflow's minutes of retries: the spool keeps what could not be sent.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no calls home from a training job

RUN_KEY_TAG = "rayjobs.run_key"
RUN_KEY_DIGEST_TAG = "rayjobs.run_key_sha256"
ATTEMPT_TAG = "rayjobs.attempt"
LAST_STEP_TAG = "rayjobs.last_logged_step"
MODEL_URI_TAG = "rayjobs.model_uri"
MODEL_CHECKPOINT_TAG = "rayjobs.model_checkpoint"  # the checkpoint the logged model was built from  # MLflow 3 logs models as LoggedModels, linked to the run
CREDENTIAL_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def tracking_uri(cfg: Any) -> str:
    """The run's tracking URI: ``tracking.uri``, else an sqlite store beside the results (absolute)."""
    return cfg.tracking.uri or f"sqlite:///{mlflow_db(cfg.storage_path)}"


def artifact_location(cfg: Any) -> str | None:
    """Where a new experiment keeps artifacts: beside the results for a local store; the server's choice otherwise."""
    if cfg.tracking.uri.startswith(("http://", "https://")):
        return None
    return Path(cfg.storage_path, "mlartifacts").as_uri()


@contextlib.contextmanager
def fluent_store(uri: str) -> Iterator[None]:
    """MLflow's fluent API (``mlflow.start_run``, ``register_model``) on ``uri`` for the block, then as before.

    ``mlflow.set_tracking_uri`` also sets ``MLFLOW_TRACKING_URI`` in this process's environment, which
    every later child process would inherit (a ``rayjobs eval models:/...`` after a run in the same
    Python session looked in that run's store); the previous value is put back.
    """
    import mlflow

    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)  # None unsets the variable again


def worker_env(cfg: Any) -> dict[str, str]:
    """Environment variables the workers need to reach the tracking server (credentials included)."""
    env = {
        "MLFLOW_TRACKING_URI": tracking_uri(cfg),
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    env.update({k: os.environ[k] for k in CREDENTIAL_ENV if os.environ.get(k)})
    return env


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys with string values (MLflow params), secrets redacted."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = str(redact(key, v))[:6000]
    return out


def client(uri: str):
    """An MlflowClient for ``uri`` (a new sqlite store is copied from an empty one: ``mlflow_store``)."""
    from mlflow.tracking import MlflowClient

    from rayjobs.mlflow_store import seed_uri

    seed_uri(uri)
    return MlflowClient(tracking_uri=uri)


class Tracker:
    """The one handle on MLflow for a config: its URI resolved once, and the one place that creates runs.

    ``open`` finds or creates the run of a run key (a training run's directory, a search's
    experiment directory); ``child`` opens a run under a parent; ``log_params``, ``tag``,
    ``finish`` (artifacts, the model, FINISHED), ``fail``, ``end`` and ``register`` act on a run.
    """

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.uri = tracking_uri(cfg)
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The MlflowClient of this URI (made on first use)."""
        if self._client is None:
            self._client = client(self.uri)
        return self._client

    def open(self, run_key: str, tags: dict[str, str] | None = None, run_name: str | None = None) -> str:
        """The run whose tag ``rayjobs.run_key`` is ``run_key`` (set RUNNING again), or a new one."""
        c = self.client
        run_id = self.find(run_key)
        if run_id:
            c.update_run(run_id, status="RUNNING")
            return run_id
        digest = hashlib.sha256(run_key.encode()).hexdigest()[:32]
        all_tags = {RUN_KEY_TAG: run_key, RUN_KEY_DIGEST_TAG: digest, **(tags or {})}
        name = run_name or self.cfg.tracking.run_name or self.cfg.run.name
        return c.create_run(self._experiment_id(), run_name=name, tags=all_tags).info.run_id

    def find(self, run_key: str) -> str | None:
        """The id of the run whose tag ``rayjobs.run_key`` is ``run_key``, its status untouched; None if none."""
        c = self.client
        exp_id = self._experiment_id()
        digest = hashlib.sha256(run_key.encode()).hexdigest()[:32]
        # Searched by a digest (no quote can break the filter, whatever the run's name); runs made before
        # the digest tag existed are found by their key when it has no quote.
        found = c.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_DIGEST_TAG}` = '{digest}'", max_results=1)
        if not found and "'" not in run_key:
            found = c.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'", max_results=1)
        return found[0].info.run_id if found else None

    def child(self, run_key: str, parent_run_id: str, tags: dict[str, str] | None = None) -> str:
        """A run nested under ``parent_run_id`` (a Tune trial under its search)."""
        return self.open(run_key, {"mlflow.parentRunId": parent_run_id, **(tags or {})})

    def _experiment_id(self) -> str:
        c, name = self.client, self.cfg.tracking.experiment
        exp = c.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return c.create_experiment(name, artifact_location=artifact_location(self.cfg))
        except Exception:  # noqa: BLE001 - created meanwhile by another process
            exp = c.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        """Log params not yet on the run (MLflow refuses to change a param; a changed one becomes a tag)."""
        from mlflow.entities import Param, RunTag

        existing = self.client.get_run(run_id).data.params
        new = [Param(k, v) for k, v in params.items() if k not in existing]
        changed = [
            RunTag(f"rayjobs.param_changed.{k}", f"{existing[k]} -> {v}")
            for k, v in params.items()
            if k in existing and existing[k] != v
        ]
        for i in range(0, max(len(new), len(changed)), 100):
            self.client.log_batch(run_id, params=new[i : i + 100], tags=changed[i : i + 100])

    def log_batch(
        self, run_id: str, metrics: tuple[Any, ...] | list[Any] = (), params: tuple[Any, ...] | list[Any] = ()
    ) -> None:
        """Log MLflow ``Metric`` and ``Param`` entities at once."""
        self.client.log_batch(run_id, metrics=list(metrics), params=list(params))

    def log_artifact(self, run_id: str, path: str, artifact_path: str | None = None) -> None:
        """Upload one file (or, for a directory, its files) as an artifact."""
        if os.path.isdir(path):
            self.client.log_artifacts(run_id, path, artifact_path)
        else:
            self.client.log_artifact(run_id, path, artifact_path)

    def tag(self, run_id: str, key: str, value: str) -> None:
        """Set one tag."""
        self.client.set_tag(run_id, key, value)

    def end(self, run_id: str, status: str) -> None:
        """End a run as FINISHED, FAILED or KILLED."""
        self.client.set_terminated(run_id, status)

    def fail(self, run_id: str, reason: str = "") -> None:
        """End a run FAILED (with ``rayjobs.failure`` when a reason is given)."""
        if reason:
            self.tag(run_id, "rayjobs.failure", reason)
        self.end(run_id, "FAILED")

    def finish(self, run_id: str, summary: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """After fit: config, curve, chosen checkpoints, the model (registered when asked); FINISHED."""
        log_final(self, run_id, summary, history)

    def register(self, model_uri: str, name: str) -> tuple[str, str]:
        """Register a logged model under ``name``: (name, version)."""
        import mlflow

        with fluent_store(self.uri):
            version = mlflow.register_model(model_uri, name)
        return version.name, str(version.version)


def find_or_create_run(cfg: Any, run_key: str, tags: dict[str, str] | None = None, run_name: str | None = None) -> str:
    """The run of ``run_key`` in ``cfg``'s store (``Tracker(cfg).open``)."""
    return Tracker(cfg).open(run_key, tags, run_name)


def run_tags(cfg: Any, world_size: int, device: str, nodes: int) -> dict[str, str]:
    """Tags of a run: code version, package versions, world size, strategy, device, node count."""
    import mlflow
    import ray
    import torch

    import rayjobs

    tags = {
        "rayjobs.version": rayjobs.__version__,
        "ray.version": ray.__version__,
        "torch.version": torch.__version__,
        "mlflow.version": mlflow.__version__,
        "world_size": str(world_size),
        "strategy": "single" if world_size == 1 and cfg.parallel.strategy == "ddp" else cfg.parallel.strategy,
        "device.type": device,
        "device.name": torch.cuda.get_device_name(0) if device == "gpu" and torch.cuda.is_available() else device,
        "nodes": str(nodes),
        "run.name": cfg.run.name,
        **{k: str(redact(k, v)) for k, v in cfg.tracking.tags.items()},
    }
    commit = _git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    if cfg.model.init_from:
        tags["rayjobs.init_from"] = cfg.model.init_from  # where the warm start's weights came from
    return tags


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


class MetricsLogger:
    """Rank 0's MLflow logger. ``log`` appends to a spool file on disk (a crash loses nothing) and
    returns; a thread sends the spool in batches every few seconds, and keeps it while the server
    is away.

    Points are keyed by global step. A point whose step is not beyond what the run already had
    when this attempt connected (tag ``rayjobs.last_logged_step``), or not beyond the last step
    sent for its key, is a replay after a resume and is dropped: each step is logged at most once.
    """

    FLUSH_EVERY_S = 2.0

    def __init__(self, cfg: Any, run_id: str | None, run_key: str, spool_path: str, attempt: int | None = None) -> None:
        self.cfg, self.uri, self.run_id, self.run_key = cfg, tracking_uri(cfg), run_id, run_key
        self.spool = Path(spool_path)
        self.sending = pending_path(spool_path)
        self.attempt = attempt  # this training start's number (None: a replay, not a start)
        self.last_step: int | None = None  # the run's tag when this attempt connected
        self.key_step: dict[str, int] = {}  # last step sent, per metric key
        self.warned = False
        self.spool_warned = False
        self.sent_points = 0
        self.dropped_points = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rayjobs-mlflow", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Append metrics at ``step`` (numbers only) to the spool; returns at once."""
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        if not clean:
            return
        line = json.dumps({"step": step, "metrics": clean, "t": int(time.time() * 1000)}) + "\n"
        with self._lock:
            try:
                self.spool.parent.mkdir(parents=True, exist_ok=True)
                with open(self.spool, "a") as f:
                    f.write(line)
            except OSError as exc:  # a full or read-only disk: these points are lost, training goes on
                self.dropped_points += len(clean)
                self._warn_spool(exc)

    def _warn_spool(self, exc: OSError) -> None:
        if not self.spool_warned:
            self.spool_warned = True
            log(
                f"warning: cannot write the MLflow spool {self.spool} ({type(exc).__name__}: {exc}); "
                "training goes on without these metrics until it can"
            )

    def close(self, timeout: float = 30.0) -> bool:
        """Send what is spooled; True when everything reached the server (else it stays on disk)."""
        self._stop.set()
        self._thread.join(timeout)
        return not self.spool.exists() and not self.sending.exists()

    # -- the sending thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self.FLUSH_EVERY_S)
            try:
                self._rotate()
            except OSError as exc:  # the run directory turned read-only or full: what is spooled stays there
                self._warn_spool(exc)
            if self.sending.exists():
                self._send_spool()
            if stopping:
                return

    def _rotate(self) -> None:
        """Move what ``log`` appended into the file being sent (appending if one is still there)."""
        with self._lock:
            if not self.spool.exists():
                return
            if self.sending.exists():
                with open(self.sending, "a") as out:
                    out.write(self.spool.read_text())
                self.spool.unlink()
            else:
                os.replace(self.spool, self.sending)

    def _connect(self) -> None:
        if self.run_id is None:
            self.run_id = find_or_create_run(self.cfg, self.run_key)
        if self.last_step is None:
            c = client(self.uri)
            tags = c.get_run(self.run_id).data.tags
            self.last_step = int(tags.get(LAST_STEP_TAG, -1))
            if self.attempt is not None and self.attempt > int(tags.get(ATTEMPT_TAG, 0)):
                c.set_tag(self.run_id, ATTEMPT_TAG, str(self.attempt))

    def _send_spool(self) -> None:
        """Send the spool in order, then remove it; on failure keep it and warn once."""
        from mlflow.entities import Metric, RunTag

        try:
            self._connect()
            lines = [json.loads(line) for line in self.sending.read_text().splitlines() if line.strip()]
            points, seen = [], dict(self.key_step)  # `seen` also drops replays inside the spool
            for e in lines:
                for k, v in e["metrics"].items():
                    if e["step"] > max(self.last_step, seen.get(k, -1)):
                        points.append(Metric(k, v, e["t"], e["step"]))
                        seen[k] = e["step"]
            c = client(self.uri)
            for i in range(0, len(points), 500):
                chunk = points[i : i + 500]
                top = max(m.step for m in chunk)
                c.log_batch(self.run_id, metrics=chunk, tags=[RunTag(LAST_STEP_TAG, str(top))])
                for m in chunk:  # sent: never again, even if a later chunk fails and the spool stays
                    self.key_step[m.key] = max(self.key_step.get(m.key, -1), m.step)
                self.sent_points += len(chunk)
            self.sending.unlink()
            if self.warned:
                log(f"MLflow is reachable again: replayed the spooled metrics to run {self.run_id}")
                self.warned = False
        except Exception as exc:  # noqa: BLE001 - any failure: keep the spool, try again later
            if not self.warned:
                self.warned = True
                log(
                    f"warning: MLflow at {self.uri} is unavailable ({type(exc).__name__}); training goes on, "
                    f"metrics are spooled to {self.spool} and replayed when it is back"
                )


def pending_path(spool_path: str | os.PathLike[str]) -> Path:
    """The spool file being sent (what ``log`` appended is moved there before sending)."""
    return Path(f"{spool_path}.sending")


def has_pending(spool_path: str | os.PathLike[str]) -> bool:
    """Whether a run has spooled metrics that have not reached the server."""
    return Path(spool_path).exists() or pending_path(spool_path).exists()


def log_final(tracker: Tracker, run_id: str, summary: dict[str, Any], history: list[dict[str, Any]]) -> None:
    """Driver, after fit: config, curve, chosen checkpoints, the model (registered when asked); end the run."""
    import tempfile

    import yaml

    from rayjobs.checkpoint import list_checkpoints

    cfg, c = tracker.cfg, tracker.client
    with tempfile.TemporaryDirectory() as d:
        cfg_path = Path(d, "config.yaml")
        cfg_path.write_text(yaml.safe_dump(_redacted_config(cfg), sort_keys=False))
        tracker.log_artifact(run_id, str(cfg_path))
        if history:
            curve = Path(d, "learning_curve.png")
            draw_curve(history, curve, cfg.run.name)
            tracker.log_artifact(run_id, str(curve))
    kept = [ck for ck in list_checkpoints(cfg.run_dir, check=False) if ck.complete]
    chosen = _chosen_checkpoints(cfg, kept, summary.get("checkpoint"))
    for path in chosen:
        tracker.log_artifact(run_id, path, f"checkpoints/{Path(path).name}")
    final = summary.get("checkpoint")
    if final and c.get_run(run_id).data.tags.get(MODEL_CHECKPOINT_TAG) != final:
        log_model(tracker, run_id, final)
        tracker.tag(run_id, MODEL_CHECKPOINT_TAG, final)  # a re-run of a finished run logs (and registers) no copy
    if summary.get("early_stop"):
        tracker.tag(run_id, "rayjobs.early_stop", summary["early_stop"])
    tracker.end(run_id, "FINISHED")


def _redacted_config(cfg: Any) -> dict[str, Any]:
    from rayjobs.config import redacted_dump

    return redacted_dump(cfg)


def _chosen_checkpoints(cfg: Any, kept: list[Any], final: str | None) -> list[str]:
    mode = cfg.tracking.log_checkpoints
    if mode == "none" or not kept:
        return []
    if mode == "all":
        return [k.path for k in kept]
    if mode == "last":
        return [final] if final else [kept[-1].path]
    scored = [k for k in kept if cfg.checkpoint.metric in k.metrics]
    if not scored:
        return [final] if final else []
    best = sorted(scored, key=lambda k: k.metrics[cfg.checkpoint.metric], reverse=cfg.checkpoint.mode == "max")[0]
    return [best.path]


def draw_curve(history: list[dict[str, Any]], out: Path, title: str) -> None:
    """Train and validation loss (and validation accuracy) against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("train/loss", "val/loss"):
        pts = [(h["step"], h[key]) for h in history if key in h]
        if pts:
            ax.plot(*zip(*pts), label=key, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    acc = [(h["step"], h["val/accuracy"]) for h in history if "val/accuracy" in h]
    if acc:
        ax2 = ax.twinx()
        ax2.plot(*zip(*acc), color="tab:green", label="val/accuracy", marker=".")
        ax2.set_ylabel("val/accuracy")
        ax2.legend(loc="center right")
    ax.legend(loc="upper right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def log_model(tracker: Tracker, run_id: str, checkpoint: str) -> None:
    """The final weights as an MLflow PyTorch model with signature and input example; registered if asked."""
    import mlflow
    import numpy as np
    import torch
    from mlflow.models import infer_signature

    from rayjobs import data as data_lib
    from rayjobs.checkpoint import load_for_inference

    cfg = tracker.cfg
    info, example = data_lib.example_inputs(cfg.data.name, cfg.data.kwargs)
    model, _ = load_for_inference(checkpoint, cfg=cfg, info=info)
    with torch.no_grad():
        output = model(example)
    signature = infer_signature(example.numpy(), output.numpy())
    with fluent_store(tracker.uri), mlflow.start_run(run_id=run_id):
        info = mlflow.pytorch.log_model(
            model,
            name="model",
            signature=signature,
            input_example=example.numpy(),
            registered_model_name=cfg.tracking.register_as or None,
            # "pt2": a traced graph (torch.export), loaded without unpickling code.
            serialization_format="pt2",
            # Stated, not inferred: inference imports every package in sight (~6 s).
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"numpy=={np.__version__}"],
        )
        mlflow.set_tag(MODEL_URI_TAG, info.model_uri)
