"""The schema of a run: one typed, validated config drives train, tune and submit.

A config is YAML plus ``--set key=value`` overrides. Every problem is reported as one line that
names the field path, what was given and what is allowed, before any Ray process starts.
The config crosses the Ray boundary as a plain dict (``model_dump()``) and workers rebuild it.
"""

from __future__ import annotations

import difflib
import os
import re
import unicodedata
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rayjobs.errors import ConfigError
from rayjobs.typed_kwargs import plain_types, true_or_false_for_a_number

HF_PREFIX = "hf:"  # model.name: hf:<dir>, a Hugging Face model directory (models.hf)

CONFIG_DIR = Path(__file__).parent / "configs"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = CONFIG_DIR / "digits.yaml"


class Section(BaseModel):
    """Base of every config section: unknown keys are errors; numbers are accepted for strings; a number
    is finite (``lr: inf`` trained to NaN) and never a YAML ``true`` (``epochs: true`` ran 1 epoch)."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_true_or_false_for_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        hint = cls.model_fields[info.field_name].annotation if info.field_name in cls.model_fields else None
        if true_or_false_for_a_number(v, hint):
            raise PydanticCustomError("int_type" if int in plain_types(hint) else "float_type", "not a number")
        return v


class RunSection(Section):
    name: str = Field("", description="Stable run name (no timestamps); empty: '<model>-<data>'.")
    storage_path: str = Field(
        "results",
        description="Where results and checkpoints go: a path (made absolute; shared by every node on a cluster) "
        "or an object store URI (s3://, gs://, abfs://, hdfs://) for the checkpoints.",
    )
    local_dir: str = Field(
        "",
        description="With an object store storage_path: each node's working directory (logs, MLflow spool, a cache "
        "of checkpoints); empty: ~/.cache/rayjobs/<scheme>/<bucket>/<prefix>.",
    )

    @field_validator("name")
    @classmethod
    def _name_is_a_path_segment(cls, v: str) -> str:
        return plain_name(v)

    @field_validator("storage_path")
    @classmethod
    def _a_path_or_an_object_store(cls, v: str) -> str:
        from rayjobs.storage.uri import check_uri, is_uri

        if not v.strip():  # os.path.abspath("") is the working directory: runs landed beside the user's files
            raise ValueError("empty; give a directory (the default is results) or an object store URI")
        if is_uri(v):
            check_uri(v)
        return v

    @model_validator(mode="after")
    def _local_dir_needs_an_object_store(self) -> RunSection:
        from rayjobs.storage.uri import is_uri

        if self.local_dir and not is_uri(self.storage_path):
            raise _MultiError(
                [
                    (
                        "run.local_dir",
                        f"is only used with an object store run.storage_path (s3://...); with the path "
                        f"{self.storage_path!r} everything goes there: remove run.local_dir, got {self.local_dir!r}",
                    )
                ]
            )
        return self


def plain_name(v: str) -> str:
    """A run or search name is one directory: no '/', not '.' or '..', no control characters; and ASCII,
    because Ray Train tags its metrics with the run's name and Ray's metrics take ASCII only."""
    if "/" in v or "\\" in v or v in (".", "..") or any(ord(c) < 32 for c in v):
        raise ValueError(f"must be a plain name without '/' (one directory), got {v!r}")
    if not v.isascii():
        raise ValueError(f"must be ASCII letters, digits and punctuation (Ray tags its metrics with it), got {v!r}")
    return v


def ascii_name(name: str) -> str:
    """``name`` in ASCII for a default run name (an ``hf:`` folder may be named in any script): accents
    dropped (``Modèle`` -> ``Modele``), other letters left out."""
    return unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode().strip("-") or "run"


class ModelSection(Section):
    name: str = Field("digits_cnn", description="Registry name, or 'package.module:callable' for your own model.")
    flavor: str = Field(
        "", description="Size preset of a registry model (every model has 'debug'); empty: its default."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the model builder.")
    init_from: str = Field(
        "",
        description="Warm start: the weights (only: a fresh optimizer, step 0) of a checkpoint PATH, runs:/RUN_ID "
        "or models:/NAME/VERSION|latest|@ALIAS; a run's own checkpoints take precedence when it restarts.",
    )

    @model_validator(mode="after")
    def _known_model(self) -> ModelSection:
        problems = _model_problems(self)
        if problems:
            raise _MultiError(problems)
        if self.flavor == "" and ":" not in self.name:  # a registry model (not a callable, not hf:)
            from models import get_spec

            self.flavor = get_spec(self.name).default_flavor
        return self


class DataSection(Section):
    name: str = Field(
        "digits",
        description="Dataset: digits | diabetes | synthetic (in memory); parquet | csv | images | text (Ray Data); "
        "package.module:callable returning your (train, val[, test]) torch Datasets.",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the dataset loader.")

    @model_validator(mode="after")
    def _known_data(self) -> DataSection:
        problems = _data_problems(self)
        if problems:
            raise _MultiError(problems)
        return self

    @property
    def kind(self) -> str:
        """The kind of samples this dataset gives: image or tokens."""
        from rayjobs.data import spec

        return spec(self.name).kind(self.kwargs)


# Where each kind of sample comes from: the fix named when a model is given data of another kind.
DATA_OF_KIND = {
    "tokens": "tokens come from data.name=text (a folder of .txt files), a Parquet of token ids "
    "(`rayjobs data prepare text`), or data.name=synthetic with data.kwargs.kind=tokens (--config gpt-synthetic)",
    "image": "images come from data.name=digits, images (a folder per class), a Parquet of them "
    "(`rayjobs data prepare digits`), or synthetic",
}


class TaskSection(Section):
    name: str = Field(
        "auto",
        description="classification | lm | regression | package.module:callable (your task); "
        "auto: regression for real-valued targets, lm for tokens, else classification.",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for your task's callable.")


class OptimSection(Section):
    name: str = Field(
        "adamw",
        description="adamw | sgd | torch.optim.<Name> (e.g. torch.optim.RMSprop) | package.module:callable "
        "(called with the parameter groups, lr=, weight_decay= and optim.kwargs).",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="More arguments for the optimizer.")
    decay_norms_and_biases: bool = Field(
        False, description="Weight decay on biases and norm weights (1-D tensors) too; by default only on matrices."
    )
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled (adamw) or L2 (sgd) weight decay.")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum (sgd only).")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="LR schedule after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0 over this many optimizer steps.")
    grad_clip: float = Field(0.0, ge=0, description="Clip the global gradient norm to this value; 0 = off.")

    @field_validator("name")
    @classmethod
    def _known_optimizer(cls, v: str) -> str:
        if v in ("adamw", "sgd"):
            return v
        if _is_import_path(v):
            from models.registry import resolve_callable

            try:
                resolve_callable(v)
            except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
                raise ValueError(f"cannot import it: {type(exc).__name__}: {exc}") from None
            return v
        if v.startswith("torch.optim."):
            import torch

            found = getattr(torch.optim, v.removeprefix("torch.optim."), None)
            if isinstance(found, type) and issubclass(found, torch.optim.Optimizer):
                return v
            raise ValueError(f"torch.optim has no optimizer {v.removeprefix('torch.optim.')!r}, got {v!r}")
        hint = _did_you_mean(v, ["adamw", "sgd"])
        raise ValueError(f"must be adamw, sgd, torch.optim.<Name> or package.module:callable{hint}, got {v!r}")


class EarlyStopSection(Section):
    metric: str = Field("", description="Eval metric watched (val/...); empty: the task's (val/accuracy, val/r2, ...).")
    mode: Literal["", "min", "max"] = Field("", description="Whether lower or higher is better; empty: the task's.")
    patience: int = Field(0, ge=0, description="Stop after this many evals without improvement; 0 = off.")
    min_delta: float = Field(0.0, ge=0, description="An improvement must beat the best by more than this.")


class TrainingSection(Section):
    epochs: int = Field(10, ge=1, description="Passes over the training data.")
    max_steps: int = Field(0, ge=0, description="Stop after this many optimizer steps; 0 = no limit.")
    batch_size: int = Field(64, ge=1, description="Global batch: summed over workers and accumulation steps.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Autocast dtype; fp16 needs a GPU.")
    seed: int = Field(0, description="Seed of model init, data order and dropout.")
    eval_every: int = Field(0, ge=0, description="Evaluate every N optimizer steps; 0 = at each epoch's end.")
    log_every: int = Field(20, ge=1, description="Print train loss every N optimizer steps.")
    nan_policy: Literal["stop", "skip"] = Field(
        "stop",
        description="A NaN/Inf loss on any rank: stop every rank (checked every logged step, before evals and "
        "saves; nothing after it is saved), or skip that step (checked every step).",
    )
    early_stop: EarlyStopSection = Field(
        default_factory=EarlyStopSection, description="Stop a run whose eval metric stops improving."
    )


class ScalingSection(Section):
    num_workers: int | Literal["auto"] | list[int] = Field(
        "auto",
        description="Train workers; 0 = local mode in this process; auto = 1 per GPU, else 2; "
        "[min, max] = elastic: start with min, grow to max as nodes join.",
    )
    elastic_resize_interval_s: float = Field(
        60.0, gt=0, description="Elastic runs: how often Ray Train looks for room to grow the worker group."
    )
    use_gpu: bool | Literal["auto"] = Field("auto", description="One GPU per worker: true | false | auto.")
    resources_per_worker: dict[str, float] = Field(
        default_factory=dict, description="Ray resources per worker, e.g. {CPU: 1, GPU: 1}."
    )
    accelerator_type: str = Field(
        "", description="Pin workers to this GPU type (Ray's accelerator_type, e.g. H100, A100); empty: any."
    )

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> Any:
        if v == "auto":
            return v
        if isinstance(v, (list, tuple)):
            ok = len(v) == 2 and all(isinstance(n, int) and not isinstance(n, bool) for n in v)
            if not ok or not 1 <= v[0] < v[1]:
                raise ValueError(f"elastic workers are [min, max] with 1 <= min < max, got {list(v)!r}")
            return list(v)
        if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, str) and v.isdigit())):
            raise ValueError(f"must be an integer >= 0 or 'auto', got {v!r}")
        if int(v) < 0:
            raise ValueError(f"must be an integer >= 0 or 'auto', got {v!r}")
        return int(v)

    @field_validator("use_gpu", mode="before")
    @classmethod
    def _use_gpu(cls, v: Any) -> Any:
        if isinstance(v, bool) or v == "auto":
            return v
        if isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        raise ValueError(f"must be true, false or 'auto', got {v!r}")

    @field_validator("resources_per_worker")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        for key, amount in v.items():
            if amount < 0:
                raise ValueError(f"{key} must be >= 0, got {amount}")
        return v


# The names parallel.strategy accepts: each is a row of rayjobs.parallel.layout.STRATEGIES (a test checks).
STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "pp", "fsdp+tp", "pp+dp", "dataparallel")


class ParallelSection(Section):
    """How the model and the data are split over the workers (see rayjobs/parallel/).

    Degrees left at 0 are derived from ``strategy`` and the world size; their product is the world size.
    """

    strategy: Literal[STRATEGIES] = Field(  # type: ignore[valid-type]
        "ddp",
        description=(
            "ddp | fsdp (FSDP2) | hsdp (2-D: replicate x shard) | tp | pp | fsdp+tp | pp+dp | dataparallel "
            "(one worker drives all its node's GPUs through nn.DataParallel)."
        ),
    )
    dp_replicate: int = Field(0, ge=0, description="Replicas (DDP, or HSDP's outer dimension); 0 = derived.")
    dp_shard: int = Field(0, ge=0, description="FSDP2 shards per replica; 0 = derived.")
    tp: int = Field(0, ge=0, description="Tensor-parallel degree (must divide the heads); 0 = derived.")
    pp: int = Field(0, ge=0, description="Pipeline stages (at most the model's layers); 0 = derived.")
    pp_schedule: Literal["gpipe", "1f1b"] = Field("1f1b", description="Pipeline schedule.")
    microbatches: int = Field(0, ge=0, description="Pipeline micro-batches per step; 0 = 2 x stages.")
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none", description="Recompute activations in backward: every block (full) or every ac_every-th block."
    )
    ac_every: int = Field(2, ge=1, description="With activation_checkpointing=selective: every N-th block.")
    compile: bool = Field(False, description="torch.compile each block (after TP and checkpointing, before FSDP).")
    fsdp_param_dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="FSDP2 parameter dtype in compute (reduce stays fp32); auto: bf16 on GPU, fp32 on CPU."
    )
    cpu_offload: bool = Field(False, description="FSDP2: keep parameters, gradients and optimizer state on CPU.")
    allow_mixed_devices: bool = Field(
        False, description="Unlike devices across workers only warn (instead of failing before training)."
    )


def reported_metric(name: str) -> str:
    """``name`` if it names an eval metric (``val/<metric>``) or the training loss; which metrics the
    run's task reports is checked with the whole config (``RunConfig._task_fits``)."""
    if name != "train/loss" and not (name.startswith("val/") and len(name) > 4):
        raise ValueError(f"must be val/<metric> (what every eval reports) or train/loss, got {name!r}")
    return name


def better_direction(task: Any, name: str) -> str:
    """ "min" or "max" where the direction of ``name`` (``val/<metric>``, ``train/loss``) is known: the task's
    own metric goes its ``mode``; losses and errors go down, accuracy and r2 up; "" for any other metric."""
    metric = name.split("/", 1)[-1]
    if metric == task.metric:
        return task.mode
    return {"loss": "min", "mse": "min", "mae": "min", "rmse": "min", "accuracy": "max", "r2": "max"}.get(metric, "")


class CheckpointSection(Section):
    model_config = ConfigDict(
        extra="forbid",
        coerce_numbers_to_str=True,
        validate_assignment=True,
        populate_by_name=True,
        serialize_by_alias=True,
    )

    every_steps: int = Field(0, ge=0, description="Checkpoint every N optimizer steps; 0 = off.")
    every_epochs: int = Field(
        1, ge=0, description="Checkpoint every N epochs; 0 = off. One is always taken at the end."
    )
    keep_last: int = Field(2, ge=1, description="Keep this many newest complete checkpoints.")
    keep_best: int = Field(0, ge=0, description="Also keep this many best by `metric`.")
    metric: str = Field("val/loss", description="Metric that ranks checkpoints for keep_best.")
    mode: Literal["min", "max"] = Field("min", description="Whether a lower or higher `metric` is better.")
    async_save: bool = Field(False, alias="async", description="Write checkpoints while training goes on.")
    resume_from: str = Field("", description="Resume from this checkpoint; empty: this run's newest complete one.")

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, v: str) -> str:
        return reported_metric(v)


class FaultsSection(Section):
    """Fault injection, off by default: for tests, and for users who want to see their job resume."""

    kill_rank: int = Field(0, ge=0, description="Rank that kill_at_step kills.")
    kill_at_step: int = Field(0, ge=0, description="Kill that rank hard (SIGKILL) at this step, once; 0 = off.")
    raise_at_step: int = Field(0, ge=0, description="Raise an error on rank 0 at this step, once; 0 = off.")
    nan_rank: int = Field(0, ge=0, description="Rank whose loss nan_at_step makes NaN.")
    nan_at_step: int = Field(0, ge=0, description="Make the loss NaN on nan_rank at this step; 0 = off.")
    corrupt_latest_checkpoint: bool = Field(False, description="Corrupt the newest checkpoint before resuming, once.")
    oom_at_step: int = Field(
        0, ge=0, description="Ask the allocator for far too much memory on rank 0 at this step; 0 = off."
    )


class TrackingSection(Section):
    enabled: bool = Field(True, description="Record the run in MLflow.")
    uri: str = Field("", description="MLflow tracking URI (http://... for a server); empty: sqlite beside the results.")
    experiment: str = Field("rayjobs", description="MLflow experiment name.")
    run_name: str = Field("", description="MLflow run name; empty: run.name.")
    tags: dict[str, str] = Field(default_factory=dict, description="Extra tags on the MLflow run.")
    log_every: int = Field(10, ge=1, description="Log per-step train metrics every N optimizer steps.")
    log_checkpoints: Literal["none", "best", "last", "all"] = Field(
        "last", description="Which checkpoints to upload as artifacts at the end."
    )
    register_as: str = Field("", description="Register the final model under this Model Registry name; empty: don't.")

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        if v and not v.startswith(("http://", "https://", "sqlite:///", "file:/", "databricks")):
            raise ValueError(f"must be http(s)://HOST:PORT, sqlite:///ABS/PATH.db or file:/ABS/PATH, got {v!r}")
        if v.startswith(("http://", "https://")) and "@" in v.split("://", 1)[1].split("/", 1)[0]:
            scheme, rest = v.split("://", 1)
            shown = f"{scheme}://***@{rest.split('@', 1)[1]}"
            raise ValueError(
                f"must not hold credentials (they would be printed and stored with every run): got {shown}; "
                "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead"
            )
        return v


SPACE_KINDS = ("choice", "grid", "uniform", "loguniform", "randint", "quniform")


class TuneSection(Section):
    name: str = Field("", description="Search (Tune experiment) name; empty: 'tune-<run.name>'.")

    @field_validator("name")
    @classmethod
    def _name_is_a_path_segment(cls, v: str) -> str:
        return plain_name(v)

    space: dict[str, Any] = Field(  # each value is checked by tune.space_problems, which names the kinds
        default_factory=dict,
        description="Dotted config path -> {choice|grid: [...]} or {uniform|loguniform|randint: [lo, hi]} or {quniform: [lo, hi, q]}.",
    )
    num_samples: int = Field(4, ge=1, description="Trials (each grid point is repeated this many times).")
    metric: str = Field("val/accuracy", description="Metric the search optimizes (reported at every eval).")
    mode: Literal["min", "max"] = Field("max", description="Whether lower or higher `metric` is better.")
    search: Literal["random", "optuna"] = Field(
        "random", description="Search algorithm: random (and grid) or optuna (TPE)."
    )
    scheduler: Literal["fifo", "asha", "pbt"] = Field("fifo", description="Trial scheduler.")
    time_attr: Literal["step", "epoch"] = Field(
        "step", description="Unit of grace_period, max_t, perturbation_interval."
    )
    grace_period: int = Field(1, ge=1, description="ASHA: a trial runs at least this long before it can be stopped.")
    reduction_factor: int = Field(2, ge=2, description="ASHA: keep 1/reduction_factor of the trials at each rung.")
    max_t: int = Field(0, ge=0, description="ASHA: longest a trial runs; 0 = the run's full length.")
    perturbation_interval: int = Field(
        0, ge=0, description="PBT: exploit/explore every N time_attr units; 0 = every eval."
    )
    max_concurrent_trials: int | Literal["auto"] = Field(
        "auto", description="Trials at once; auto = cluster CPUs / per-trial CPUs."
    )
    trial_cpus: float = Field(
        0.1, gt=0, description="CPUs reserved for each trial's driver (its workers reserve their own)."
    )
    time_budget_s: float = Field(0, ge=0, description="Stop the search after this many seconds; 0 = no limit.")
    max_failures: int = Field(
        2, ge=0, description="Retries of a failed trial (each resumes from the trial's own checkpoints)."
    )

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, v: str) -> str:
        return reported_metric(v)

    @field_validator("space", mode="before")
    @classmethod
    def _flat_paths(cls, v: Any) -> Any:
        """``--set tune.space.optim.lr=...`` nests by dots; a space is keyed by the full dotted path."""
        if not isinstance(v, dict):
            return v
        flat: dict[str, Any] = {}

        def walk(node: dict[str, Any], prefix: str) -> None:
            for key, value in node.items():
                path = f"{prefix}{key}"
                if isinstance(value, dict) and value and not (set(value) & set(SPACE_KINDS)):
                    walk(value, f"{path}.")
                else:
                    flat[path] = value

        walk(v, "")
        return flat

    @field_validator("max_concurrent_trials", mode="before")
    @classmethod
    def _concurrency(cls, v: Any) -> Any:
        if v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"must be an integer >= 1 or 'auto', got {v!r}")
        return v


class FailureSection(Section):
    max_failures: int = Field(0, ge=-1, description="Worker-group restarts allowed; -1 = unlimited.")


class RunConfig(Section):
    """A complete description of a training run."""

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    task: TaskSection = Field(default_factory=TaskSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    training: TrainingSection = Field(default_factory=TrainingSection)
    scaling: ScalingSection = Field(default_factory=ScalingSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    failure: FailureSection = Field(default_factory=FailureSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    tune: TuneSection = Field(default_factory=TuneSection)
    faults: FaultsSection = Field(default_factory=FaultsSection)

    @model_validator(mode="after")
    def _model_fits_data(self) -> RunConfig:
        if self.model.name.startswith(HF_PREFIX) and self.data.kind != "tokens":
            raise _MultiError(
                [("model.name", f"{self.model.name} is a causal LM: it needs tokens data, but data.name="
                  f"{self.data.name} gives {self.data.kind}; {DATA_OF_KIND['tokens']}")]
            )  # fmt: skip
        if self.model.name.startswith(HF_PREFIX):
            from models import hf
            from rayjobs.data import data_info

            found = hf.fit_problems(self.model.name, self.model.kwargs, data_info(self.data.name, self.data.kwargs))
            if found:
                raise _MultiError([("model.name", line) for line in found])
        if ":" not in self.model.name:
            from models import get_spec

            spec = get_spec(self.model.name)
            if self.data.kind not in spec.data_kinds:
                raise _MultiError(
                    [
                        (
                            "model.name",
                            f"{self.model.name} needs {' or '.join(spec.data_kinds)} data, "
                            f"but data.name={self.data.name} gives {self.data.kind}; "
                            + "; ".join(DATA_OF_KIND[k] for k in spec.data_kinds if k in DATA_OF_KIND),
                        )
                    ]
                )
        self._task_fits()
        if not self.run.name:
            base = self.model.name.rsplit(":", 1)[-1]
            base = (
                os.path.basename(base.rstrip("/")) if self.model.name.startswith(HF_PREFIX) else base.rsplit(".", 1)[-1]
            )
            self.run.name = ascii_name(f"{base}-{self.data.name.rsplit(':', 1)[-1].rsplit('.', 1)[-1]}")
        return self

    def _task_fits(self) -> None:
        """The task exists, suits the data's targets, and reports the metrics tune and checkpoints rank by;
        ``task.name: auto`` becomes the task the data implies, and metrics left unset become the task's."""
        from rayjobs import tasks
        from rayjobs.data import spec

        data = spec(self.data.name)
        targets = "class" if data.streaming else data.info(self.data.kwargs).targets  # files are read in preflight
        if self.task.name == "auto":
            self.task.name = tasks.default_task(self.data.kind, targets)
        if self.task.name not in tasks.SHIPPED and not _is_import_path(self.task.name):
            hint = _did_you_mean(self.task.name, list(tasks.SHIPPED))
            known = f"known: {' | '.join(tasks.SHIPPED)} (or package.module:callable)"
            raise _MultiError([("task.name", f"unknown task {self.task.name!r}{hint}; {known}")])
        try:
            task = tasks.build_task(self.task.name, self.task.kwargs)
        except Exception as exc:  # noqa: BLE001 - a user's task that cannot be built is the user's to fix
            raise _MultiError(
                [("task.name", f"cannot build {self.task.name!r}: {type(exc).__name__}: {exc}")]
            ) from None
        if task.targets != targets:
            what = {"class": "integer class labels", "real": "real-valued targets"}
            raise _MultiError(
                [("task.name", f"task {task.name} needs {what[task.targets]}, but data.name={self.data.name} gives "
                  f"{what.get(targets, targets)}; pick a task for this data (or task.name=auto)")]
            )  # fmt: skip
        self._metrics_fit(task)

    def _metrics_fit(self, task: Any) -> None:
        """Each ranked metric (checkpoints, the search, early stopping) is one the task reports and goes the
        right way: a mode left unset follows the metric where its direction is known (``better_direction``);
        a mode given against it is an error (the worst checkpoints were kept, the worst trial picked)."""
        from rayjobs import tasks

        tune, stop = self.tune, self.training.early_stop
        if "metric" not in tune.model_fields_set:
            tune.metric = f"val/{task.metric}"
        if stop.patience and not stop.metric:
            stop.metric = f"val/{task.metric}"
        allowed = tasks.reported(task)
        ranked = [("checkpoint", self.checkpoint), ("tune", tune)] + (
            [("training.early_stop", stop)] if stop.patience else []
        )
        for section, part in ranked:
            if part.metric not in allowed:
                raise _MultiError(
                    [(f"{section}.metric", f"task {task.name} reports {', '.join(allowed)} at every eval, not {part.metric!r}")]
                )  # fmt: skip
            better = better_direction(task, part.metric)
            if better and not ("mode" in part.model_fields_set and part.mode):
                part.mode = better
            elif better and part.mode != better:
                lower = "lower" if better == "min" else "higher"
                raise _MultiError(
                    [(f"{section}.mode", f"{part.mode} ranks {part.metric} backwards (a {lower} "
                      f"{part.metric.split('/', 1)[1]} is better); set {section}.mode={better}")]
                )  # fmt: skip
            elif not part.mode:
                raise _MultiError(
                    [(f"{section}.mode", f"set min or max: is a lower or a higher {part.metric} better?")]
                )

    @property
    def storage_path(self) -> str:
        """The absolute local storage path: run.storage_path, or run.local_dir when that is an object store URI."""
        from rayjobs.storage.uri import cache_dir_for, is_uri

        if is_uri(self.run.storage_path):
            return os.path.abspath(os.path.expanduser(self.run.local_dir or cache_dir_for(self.run.storage_path)))
        return os.path.abspath(os.path.expanduser(self.run.storage_path))

    @property
    def storage_uri(self) -> str:
        """The object store URI of run.storage_path, or '' when it is a filesystem path."""
        from rayjobs.storage.uri import is_uri

        return self.run.storage_path if is_uri(self.run.storage_path) else ""

    @property
    def run_dir(self) -> str:
        """Where this run's checkpoints, metrics and Ray Train state live."""
        return os.path.join(self.storage_path, self.run.name)


class _MultiError(ValueError):
    """Several (path, message) problems raised from one validator."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p}: {m}" for p, m in problems))


def _is_import_path(name: str) -> bool:
    return ":" in name and not name.startswith(HF_PREFIX)


def _data_problems(d: DataSection) -> list[tuple[str, str]]:
    from rayjobs.data import DATASETS, SYNTHETIC_KINDS, bundled_kwargs_problems, spec

    if _is_import_path(d.name):
        return _user_data_problems(d, spec(d.name))
    if d.name not in DATASETS:
        hint = _did_you_mean(d.name, list(DATASETS))
        known = " | ".join(DATASETS)
        return [("data.name", f"unknown dataset {d.name!r}{hint}; known: {known} (or package.module:callable)")]
    spec = DATASETS[d.name]
    problems = _kwargs_problems("data.kwargs", spec.load, d.kwargs, f"dataset {spec.name}")
    if spec.streaming and not d.kwargs.get("path"):
        return [("data.kwargs.path", f"data.name={d.name} reads files: set data.kwargs.path to a file or folder")]
    if not spec.streaming and not problems:
        typed, wrong = bundled_kwargs_problems(d.name, d.kwargs)
        d.kwargs.update(typed)  # in place: assigning the field would validate the section again
        problems += [(f"data.kwargs.{key}", message) for key, message in wrong]
    if spec.kind(d.kwargs) not in SYNTHETIC_KINDS:
        problems.append(
            ("data.kwargs.kind", f"must be one of {', '.join(SYNTHETIC_KINDS)}, got {spec.kind(d.kwargs)!r}")
        )
    return problems


def _user_data_problems(d: DataSection, spec: Any) -> list[tuple[str, str]]:
    """A user's ``package.module:callable`` datasets: importable, its kwargs accepted, and what it
    returns usable (it is loaded once here, on the driver, and once in each worker)."""
    from models.registry import resolve_callable

    try:
        problems = _kwargs_problems("data.kwargs", resolve_callable(d.name), d.kwargs, d.name)
        if not problems:
            spec.info(d.kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure of the user's code is the user's to fix
        return [("data.name", f"cannot load {d.name!r}: {type(exc).__name__}: {exc}")]
    return problems


def _model_problems(m: ModelSection) -> list[tuple[str, str]]:
    from models import get_spec, model_names
    from models.registry import resolve_callable

    if m.name.startswith(HF_PREFIX):
        from models import hf

        found = [("model.name", line) for line in hf.problems(m.name)]
        if not found:
            found += [("model.kwargs", line) for line in hf.kwargs_problems(m.name, m.kwargs)]
        if m.flavor:
            found.append(("model.flavor", f"flavors apply to registry models only; remove it for {m.name!r}"))
        return found
    if _is_import_path(m.name):
        problems = []
        try:
            builder = resolve_callable(m.name)
        except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
            problems.append(("model.name", f"cannot import {m.name!r}: {type(exc).__name__}: {exc}"))
        else:
            problems += _kwargs_problems("model.kwargs", builder, m.kwargs, m.name)
            problems += [] if problems else _typed_model_kwargs(m, builder, {})
        if m.flavor:
            problems.append(("model.flavor", f"flavors apply to registry models only; remove it for {m.name!r}"))
        return problems
    if m.name not in model_names():
        hint = _did_you_mean(m.name, model_names())
        known = " | ".join(model_names())
        return [
            ("model.name", f"unknown model {m.name!r}{hint}; known: {known} (or package.module:callable, or hf:DIR)")
        ]
    spec = get_spec(m.name)
    problems = _kwargs_problems("model.kwargs", spec.builder, m.kwargs, m.name, skip=("info",))
    problems += [] if problems else _typed_model_kwargs(m, spec.builder, spec.ranges)
    if m.flavor and m.flavor not in spec.flavors:
        problems.append(("model.flavor", f"{m.name} has no flavor {m.flavor!r}; known: {' | '.join(spec.flavors)}"))
    return problems


def _typed_model_kwargs(m: ModelSection, builder: Any, ranges: dict[str, Any]) -> list[tuple[str, str]]:
    """``model.kwargs`` typed as the builder's hints say, within ``ranges`` (a typo or an impossible size
    failed in every worker's model constructor before); converted values replace the given ones."""
    from rayjobs.typed_kwargs import typed_kwargs

    typed, wrong = typed_kwargs(builder, m.kwargs, ranges)
    m.kwargs.update(typed)  # in place: assigning the field would validate the section again
    return [(f"model.kwargs.{key}", message) for key, message in wrong]


def _kwargs_problems(
    path: str, fn: Any, kwargs: dict[str, Any], what: str, skip: tuple[str, ...] = ()
) -> list[tuple[str, str]]:
    from rayjobs.data import accepted_kwargs

    allowed = accepted_kwargs(fn)
    if allowed is None:
        return []
    allowed = [a for a in allowed if a not in skip]
    return [
        (
            f"{path}.{key}",
            f"{what} takes no argument {key!r}{_did_you_mean(key, allowed)}; allowed: {', '.join(allowed) or 'none'}",
        )
        for key in kwargs
        if key not in allowed
    ]


def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------------------------
# Loading: YAML file + --set overrides -> RunConfig, or ConfigError with one line per problem.


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (default: the shipped digits job), apply ``key=value`` overrides, validate."""
    raw = read_yaml(find_config(path) if path else DEFAULT_CONFIG)
    file_model = dict(raw.get("model") or {}) if isinstance(raw.get("model"), dict) else {}
    file_data = dict(raw.get("data") or {}) if isinstance(raw.get("data"), dict) else {}
    for item in overrides or []:
        apply_override(raw, item)
    _drop_another_jobs_settings(raw, file_model, file_data, overrides or [])
    return from_dict(raw)


def _drop_another_jobs_settings(
    raw: dict[str, Any], file_model: dict[str, Any], file_data: dict[str, Any], overrides: list[str]
) -> None:
    """``--set model.name=X`` (or ``data.name=Y``) makes another job than the file's.

    The file's model flavor and kwargs were for the file's model, and the file's ``run.name`` names
    the file's job (its checkpoints are of that model and data): only what the user gives for the
    new job applies, and an unnamed run gets the derived name ``<model>-<data>``.
    """
    given = {item.partition("=")[0].strip() for item in overrides}
    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    other_model = model.get("name", "digits_cnn") != file_model.get("name", "digits_cnn")
    other_data = data.get("name", "digits") != file_data.get("name", "digits")
    if other_model:
        if "model.flavor" not in given and model.get("flavor") == file_model.get("flavor"):
            model.pop("flavor", None)
        if not any(k == "model.kwargs" or k.startswith("model.kwargs.") for k in given):
            model.pop("kwargs", None)
    run = raw.get("run")
    if (other_model or other_data) and isinstance(run, dict) and "run.name" not in given:
        run.pop("name", None)


def shipped_configs() -> dict[str, str]:
    """The shipped configs by name (file stem), each with its first comment line."""
    out = {}
    for f in sorted(CONFIG_DIR.glob("*.yaml")):
        first = next((line for line in f.read_text().splitlines() if line.startswith("#")), "#")
        out[f.stem] = first.lstrip("#").strip()
    return out


def find_config(path: str | os.PathLike[str]) -> Path:
    """A config file: the path if it exists, else a shipped config by name (``gpt-fsdp`` or ``gpt-fsdp.yaml``)."""
    p = Path(os.path.expanduser(path))
    if p.is_file():
        return p
    name = p.name if p.suffix in (".yaml", ".yml") else f"{p.name}.yaml"
    shipped = CONFIG_DIR / name
    if shipped.is_file() and (len(p.parts) == 1 or p.parent.name == "configs"):
        return shipped
    return p


class ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader for configs and ``--set`` values, with two of YAML 1.2's answers: ``1e-4`` is a
    number (YAML 1.1 wants ``1.0e-4``: ``loguniform: [1e-4, 1e-2]`` read as two strings), and a key given
    twice in one mapping is an error (PyYAML kept the last without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    problem=f"{key!r} is given twice in one mapping (first at line {seen[key]}); keep one",
                    problem_mark=key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_implicit_resolver(  # a copy of SafeLoader's resolvers: yaml.safe_load is unchanged
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with ``1e-4`` a number and a key given twice a ``yaml.YAMLError`` (``ConfigLoader``)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader subclass


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a config file into a dict; a missing file or bad YAML is a ConfigError."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--config: {path} is a directory; give a YAML file in it or a shipped config's name")
    if not p.is_file():
        shipped = ", ".join(shipped_configs())
        raise ConfigError(f"--config: no file {path} and no shipped config of that name; shipped: {shipped}")
    try:
        raw = load_yaml(p.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or "not UTF-8 text"
        raise ConfigError(f"--config: cannot read {path} as a YAML config: {reason}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config: invalid YAML in {path}{where}: {problem}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: {path} must be a mapping of sections (run:, model:, ...), got {type(raw).__name__}")
    return raw


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``dotted.key=value`` to ``raw``; the value is parsed as YAML and typed by the schema."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item}: expected key=value, e.g. --set optim.lr=0.001")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"--set {item}: empty part in key {key!r}")
    try:
        value = load_yaml(text) if text.strip() else ""
    except yaml.constructor.ConstructorError as exc:  # a key given twice
        raise ConfigError(f"--set {item}: {exc.problem}") from None
    except yaml.YAMLError:
        value = text
    if isinstance(value, str) or _field_is_str(parts):
        value = text  # keep strings verbatim ("1b", "007", "true" for a str field)
    set_by_path(raw, key, value, what=f"--set {item}")


def set_by_path(raw: dict[str, Any], dotted: str, value: Any, what: str = "") -> None:
    """Set ``value`` at ``a.b.c`` in a nested dict, making sections as needed."""
    parts = dotted.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{what or dotted}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _field_is_str(parts: list[str]) -> bool:
    model: Any = RunConfig
    for part in parts:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return False
        model = fields[part].annotation
    return model is str


def from_dict(raw: dict[str, Any]) -> RunConfig:
    """Validate a plain dict (YAML, or ``model_dump()`` across the Ray boundary) into a RunConfig."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def format_validation_error(exc: ValidationError) -> list[str]:
    """One line per problem: ``field.path: what is wrong, got X``."""
    lines: list[str] = []
    seen: set[str] = set()
    for err in exc.errors():
        ctx_err = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_err, _MultiError):
            for path, msg in ctx_err.problems:
                _add(lines, seen, path, msg)
            continue
        loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
        path = ".".join(loc) or "config"
        _add(lines, seen, path, _describe(err, loc))
    return lines


def _add(lines: list[str], seen: set[str], path: str, msg: str) -> None:
    if path not in seen:
        seen.add(path)
        lines.append(f"{path}: {msg}")


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in ("int", "bool", "float", "str") or part.startswith("literal["))


def _describe(err: dict[str, Any], loc: list[str]) -> str:
    kind, ctx, given = err["type"], err.get("ctx") or {}, err.get("input")
    got = f", got {given!r}"
    if kind == "extra_forbidden":
        hint = _did_you_mean(loc[-1], _siblings(loc)) or _elsewhere(loc)
        return f"unknown key{hint}; allowed: {', '.join(_siblings(loc))}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        if isinstance(limit, float) and limit.is_integer():
            limit = int(limit)
        return f"must be {bounds[kind]} {limit}{got}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected'].replace(' or ', ', ')}{got}"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"must be an integer{got}"
    if kind in ("float_parsing", "float_type"):
        return f"must be a number{got}"
    if kind == "finite_number":
        return f"must be a finite number{got}"
    if kind in ("bool_parsing", "bool_type"):
        return f"must be true or false{got}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"must be a mapping (key: value){got}"
    if kind == "string_type":
        return f"must be a string{got}"
    if kind == "missing":
        return "is required"
    msg = err["msg"].removeprefix("Value error, ")
    return msg if "got" in msg else f"{msg[:1].lower()}{msg[1:]}{got}"


def _siblings(loc: list[str]) -> list[str]:
    model: Any = RunConfig
    for part in loc[:-1]:
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return []
        model = fields[part].annotation
    return list(getattr(model, "model_fields", {}))


def _elsewhere(loc: list[str]) -> str:
    """`` (it is training.batch_size)`` for a key that belongs to another section ('' when none)."""
    word = loc[-1].lower().replace("-", "_")
    word = KEY_SYNONYMS.get(word, word)
    homes = [path for path in _field_paths(RunConfig) if path.rsplit(".", 1)[-1] == word]
    return f" (it is {' or '.join(homes)})" if 0 < len(homes) <= 2 else ""


KEY_SYNONYMS = {"learning_rate": "lr", "batch": "batch_size", "workers": "num_workers", "epoch": "epochs"}


def _field_paths(model: Any, prefix: str = "") -> list[str]:
    """Every field of a config section and its subsections, as dotted paths."""
    paths = []
    for name, field in getattr(model, "model_fields", {}).items():
        paths.append(prefix + name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            paths += _field_paths(field.annotation, f"{prefix}{name}.")
    return paths


SECRET_WORDS = ("password", "token", "secret", "key", "credential")


def redact(key: str, value: Any) -> Any:
    """Hide secrets: values under secret-sounding keys, passwords inside URLs."""
    if any(word in key.lower().rsplit(".", 1)[-1] for word in SECRET_WORDS) and value not in ("", None):
        return "***"
    if isinstance(value, str) and "://" in value and "@" in value.split("://", 1)[1].split("/", 1)[0]:
        scheme, rest = value.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return value


def redacted_dump(cfg: RunConfig) -> dict[str, Any]:
    """``cfg.model_dump(mode="json")`` with secrets hidden: what is written into checkpoints and artifacts."""

    def walk(d: Any, prefix: str = "") -> Any:
        if isinstance(d, dict):
            return {k: walk(v, f"{prefix}{k}.") for k, v in d.items()}
        return redact(prefix.rstrip("."), d)

    return walk(cfg.model_dump(mode="json"))


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML, in schema order."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def describe_fields() -> list[tuple[str, str, Any]]:
    """Every leaf field as (dotted path, description, default), for docs and ``--help``."""
    out = []
    for section, info in RunConfig.model_fields.items():
        for name, f in info.annotation.model_fields.items():
            default = f.default_factory() if f.default_factory else f.default
            out.append((f"{section}.{name}", f.description or "", default))
    return out
