"""Tasks: what a batch's loss is and which metrics an evaluation keeps (``task.name``).

A task turns the model's output and the batch's targets into a mean loss (what is trained) and
into additive sums (what is evaluated): every rank sums its share of a split, the sums are
all-reduced, and ``finish`` turns the totals into metrics. So a metric is exact over the whole
split at any world size (sums and counts, never an average of averages).

Shipped: ``classification`` (cross-entropy; loss, accuracy), ``lm`` (next-token cross-entropy;
loss, accuracy, perplexity), ``regression`` (mean squared error; loss, mse, mae, r2). A user's task
is ``package.module:callable`` returning an object with the same members (see ``Task``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

SHIPPED = ("classification", "lm", "regression")


@runtime_checkable
class Task(Protocol):
    """What rayjobs asks of a task. ``metrics`` always holds "loss"; ``metric``/``mode`` are what
    ``tune.metric`` and ``checkpoint.metric`` default to (without the ``val/`` prefix)."""

    name: str
    targets: str  # "class" (integer labels) or "real" (float targets)
    metrics: tuple[str, ...]
    metric: str
    mode: str  # "min" or "max"

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The mean loss of one batch (a scalar with a gradient)."""
        ...

    def sums(self, output: Tensor, target: Tensor) -> dict[str, float]:
        """Additive statistics of one batch (sums over its samples, and counts)."""
        ...

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        """The task's metrics (every name of ``metrics`` that ``metric_objects`` does not give) from the
        sums of a whole split."""
        ...


# Optional on a task: ``metric_objects() -> dict[str, torchmetrics.Metric]``, fresh objects for one
# evaluation, named by entries of ``metrics``. Each is updated with every batch's ``(output, target)``
# (or ``metric_inputs(output, target)`` when the task has it) and computed over the whole split;
# torchmetrics syncs its states over the ranks itself, so these too are exact at any world size.


def metric_objects(task: Task) -> dict[str, Any]:
    """The task's torchmetrics objects for one evaluation (none for the shipped tasks)."""
    make = getattr(task, "metric_objects", None)
    return dict(make()) if make is not None else {}


def metric_inputs(task: Task, output: Tensor, target: Tensor) -> tuple[Any, ...]:
    """What a task's torchmetrics objects are updated with: ``metric_inputs`` if it has one."""
    adapt = getattr(task, "metric_inputs", None)
    return tuple(adapt(output, target)) if adapt is not None else (output, target)


def _flat_logits(output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    if output.shape[:-1] != target.shape:
        raise ValueError(
            f"task: the model's output {tuple(output.shape)} does not match the targets {tuple(target.shape)}: "
            "a classifier gives one score per class for each target (output width = number of classes)"
        )
    flat = output.reshape(-1, output.shape[-1])
    return (flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat), target.reshape(-1)


@dataclass(frozen=True)
class Classification:
    """Cross-entropy over classes (one per sample, or one per position); loss and accuracy."""

    name: str = "classification"
    targets: str = "class"
    metrics: tuple[str, ...] = ("loss", "accuracy")
    metric: str = "accuracy"
    mode: str = "max"

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Mean cross-entropy (the softmax in fp32 under autocast)."""
        flat, y = _flat_logits(output, target)
        return F.cross_entropy(flat, y)

    def sums(self, output: Tensor, target: Tensor) -> dict[str, float]:
        """Summed cross-entropy, correct predictions, and the count."""
        flat, y = _flat_logits(output, target)
        return {
            "loss": F.cross_entropy(flat.float(), y, reduction="sum").item(),
            "correct": (flat.argmax(-1) == y).sum().item(),
            "count": float(y.numel()),
        }

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        """Mean loss and accuracy."""
        n = max(sums["count"], 1.0)
        return {"loss": sums["loss"] / n, "accuracy": sums["correct"] / n}


@dataclass(frozen=True)
class LanguageModel(Classification):
    """Next-token cross-entropy (the data's targets are the inputs shifted by one); adds perplexity."""

    name: str = "lm"
    metrics: tuple[str, ...] = ("loss", "accuracy", "perplexity")
    metric: str = "loss"
    mode: str = "min"

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        """Mean loss, token accuracy, and perplexity (exp of the mean loss)."""
        out = super().finish(sums)
        return {**out, "perplexity": math.exp(min(out["loss"], 50.0))}


@dataclass(frozen=True)
class Regression:
    """Mean squared error on real-valued targets; mse, mae and r2 (1 - SSE / total sum of squares)."""

    name: str = "regression"
    targets: str = "real"
    metrics: tuple[str, ...] = ("loss", "mse", "mae", "r2")
    metric: str = "r2"
    mode: str = "max"

    @staticmethod
    def _pair(output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        if output.shape != target.shape and output.shape != (*target.shape, 1):
            raise ValueError(
                f"task regression: the model's output {tuple(output.shape)} does not match the targets "
                f"{tuple(target.shape)}: give one output per target (a last layer of width 1 for one target)"
            )
        return output.reshape(target.shape).float(), target.float()

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Mean squared error."""
        return F.mse_loss(*self._pair(output, target))

    def sums(self, output: Tensor, target: Tensor) -> dict[str, float]:
        """Sums of squared and absolute errors, of the targets and their squares, and the count."""
        pred, y = self._pair(output, target)
        err = pred - y
        return {
            "sse": (err * err).sum().item(),
            "sae": err.abs().sum().item(),
            "y": y.sum().item(),
            "yy": (y * y).sum().item(),
            "count": float(y.numel()),
        }

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        """mse (also the loss), mae, and r2 against the split's own mean."""
        n = max(sums["count"], 1.0)
        total = sums["yy"] - sums["y"] ** 2 / n
        mse = sums["sse"] / n
        r2 = 1.0 - sums["sse"] / total if total > 0 else float("nan")
        return {"loss": mse, "mse": mse, "mae": sums["sae"] / n, "r2": r2}


def _shipped(name: str) -> Task:
    return {"classification": Classification, "lm": LanguageModel, "regression": Regression}[name]()


def default_task(data_kind: str, data_targets: str = "class") -> str:
    """The task ``task.name: auto`` means for a dataset: regression for real targets, lm for tokens."""
    if data_targets == "real":
        return "regression"
    return "lm" if data_kind == "tokens" else "classification"


def build_task(name: str, kwargs: dict[str, Any] | None = None) -> Task:
    """The named shipped task, or a user's ``package.module:callable(**kwargs)``; a TypeError names
    what a user's object lacks."""
    if name in SHIPPED:
        if kwargs:
            raise TypeError(f"task {name} takes no task.kwargs, got {', '.join(kwargs)}")
        return _shipped(name)
    from models.registry import resolve_callable

    task = resolve_callable(name)(**(kwargs or {}))
    missing = [
        m for m in ("name", "targets", "metrics", "metric", "mode", "loss", "sums", "finish") if not hasattr(task, m)
    ]
    if missing:
        raise TypeError(
            f"{name} returned a {type(task).__name__} without {', '.join(missing)} (see rayjobs.tasks.Task)"
        )
    if "loss" not in task.metrics or task.metric not in task.metrics or task.mode not in ("min", "max"):
        raise TypeError(
            f"{name}: metrics must include 'loss' and the task's metric {task.metric!r}, and mode be min or max; "
            f"got metrics {tuple(task.metrics)}, mode {task.mode!r}"
        )
    if task.targets not in ("class", "real"):
        raise TypeError(f"{name}: targets must be 'class' or 'real', got {task.targets!r}")
    objects = metric_objects(task)
    if objects:
        from torchmetrics import Metric  # a task that makes them imports torchmetrics itself

        wrong = [k for k, m in objects.items() if not isinstance(m, Metric) or k not in task.metrics]
        if wrong:
            raise TypeError(
                f"{name}: metric_objects() must map names in metrics {tuple(task.metrics)} to torchmetrics.Metric "
                f"objects; {', '.join(wrong)} is not"
            )
    return task


def reported(task: Task) -> tuple[str, ...]:
    """Every metric name an eval report carries for this task (and the training loss)."""
    return (*(f"val/{m}" for m in task.metrics), "train/loss")
