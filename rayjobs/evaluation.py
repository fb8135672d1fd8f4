"""``rayjobs eval``: a checkpoint's task metrics on a split of its data (or of other data of the same shape).

The model is rebuilt by ``checkpoint.load_for_inference`` (no code a checkpoint names runs unless
trusted), the task and the data come from the checkpoint's own config with the caller's ``data.*``
and ``task.*`` overrides, and the metrics are the task's sums over the whole split, as in training.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from rayjobs.errors import ConfigError

SPLITS = ("test", "val", "train")
_OVERRIDABLE = ("data.", "task.", "training.batch_size", "training.precision")


def check_arguments(split: str, overrides: list[str]) -> None:
    """ConfigError for a split or an override that eval does not take (torch-free: a typo answers at once)."""
    if split not in SPLITS:
        raise ConfigError(f"eval: --split must be one of {', '.join(SPLITS)}, got {split!r}")
    for item in overrides:
        if not item.partition("=")[0].strip().startswith(_OVERRIDABLE):
            raise ConfigError(f"eval: --set {item}: only data.*, task.*, training.batch_size and precision apply")


def evaluate_checkpoint(
    checkpoint: str | Path, split: str = "test", overrides: list[str] | None = None, trust_model: str = ""
) -> dict[str, Any]:
    """{checkpoint, run_name, step, split, data, task, metrics}: the task's metrics of ``checkpoint`` on
    ``split``; a ConfigError (one line) for a checkpoint and data that do not fit."""
    check_arguments(split, overrides or [])
    import json

    import torch

    from rayjobs import data as data_lib
    from rayjobs import stepping, tasks
    from rayjobs.checkpoint import STATE, CheckpointError, load_for_inference, saved_config
    from rayjobs.config import apply_override, from_dict
    from rayjobs.context import WorkerContext

    try:
        model, saved = load_for_inference(checkpoint, trust_model)
    except CheckpointError as exc:
        raise ConfigError(f"eval: {exc}") from None
    raw = copy.deepcopy(saved_config(checkpoint))
    for item in overrides or []:
        apply_override(raw, item)
    cfg = from_dict(raw) if overrides else saved
    fits = _fits(data_lib.data_info(saved.data.name, saved.data.kwargs), cfg, data_lib)
    if fits:
        raise ConfigError(f"eval: checkpoint {checkpoint} {fits}")
    if data_lib.is_streaming(cfg.data.name):
        raise ConfigError(
            f"eval: data.name={cfg.data.name} streams through Ray Data; eval reads in-memory datasets "
            "(digits, diabetes, synthetic, or your package.module:callable)"
        )
    splits = data_lib.load(cfg.data.name, cfg.data.kwargs)
    dataset = getattr(splits, split)
    if dataset is None or len(dataset) == 0:
        fraction = f" (data.kwargs.{split}_fraction=0)" if f"{split}_fraction" in cfg.data.kwargs else ""
        others = ", ".join(s for s in SPLITS if s != split)
        raise ConfigError(f"eval: the {split} split of {cfg.data.name} is empty{fraction}; pick --split {others}")
    task = tasks.build_task(cfg.task.name, cfg.task.kwargs)
    cpu = WorkerContext(0, 1, 0, torch.device("cpu"))
    metrics = stepping.evaluate(model, dataset, cfg, cpu, split, task=task)
    return {
        "checkpoint": str(Path(checkpoint).resolve()),
        "run_name": saved.run.name,
        "step": int(json.loads((Path(checkpoint) / STATE).read_text()).get("step", 0)),
        "split": split,
        "rows": len(dataset),
        "data": cfg.data.name,
        "task": task.name,
        "metrics": metrics,
    }


def _fits(trained_on: Any, cfg: Any, data_lib: Any) -> str:
    """'' when the model trained on ``trained_on`` takes ``cfg``'s data, else what differs."""
    given = data_lib.data_info(cfg.data.name, cfg.data.kwargs)
    want = (trained_on.input_shape, trained_on.num_classes, trained_on.targets)
    got = (given.input_shape, given.num_classes, given.targets)
    if want == got:
        return ""
    return (
        f"was trained on inputs {tuple(want[0])} with {want[1]} output(s) ({want[2]} targets), but "
        f"data.name={cfg.data.name} gives inputs {tuple(got[0])} with {got[1]} ({got[2]} targets); "
        "evaluate it on data of the same shape"
    )


def format_eval(result: dict[str, Any]) -> str:
    """The console lines of ``rayjobs eval``: which checkpoint, which split, then the metrics (loss first)."""
    m = result["metrics"]
    keys = sorted(m, key=lambda k: not k.endswith("/loss"))
    return (
        f"rayjobs: eval of {result['run_name']} at step {result['step']} on {result['data']}/{result['split']} "
        f"({result['rows']} rows, task {result['task']})\n  " + "  ".join(f"{k} {m[k]:.4f}" for k in keys)
    )
