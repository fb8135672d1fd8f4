"""Tasks: the loss and the metrics of a batch; sums that reduce exactly; the config's task checks."""

from __future__ import annotations

import pytest
import torch
from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

from rayjobs import tasks
from rayjobs.config import load_config
from rayjobs.errors import ConfigError


def _merge(parts: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(p[k] for p in parts) for k in parts[0]}


def test_regression_metrics_equal_scikit_learns_and_sum_exactly_over_shards():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(101, generator=g) * 3 + 1
    pred = y + torch.randn(101, generator=g)
    task = tasks.Regression()
    whole = task.finish(task.sums(pred.unsqueeze(1), y))  # a (N, 1) output for N targets
    assert whole["r2"] == pytest.approx(r2_score(y, pred), rel=1e-5)
    assert whole["mse"] == pytest.approx(mean_squared_error(y, pred), rel=1e-5) == whole["loss"]
    assert whole["mae"] == pytest.approx(mean_absolute_error(y, pred), rel=1e-5)
    assert task.loss(pred.unsqueeze(1), y).item() == pytest.approx(whole["mse"], rel=1e-5)
    # Three unequal shards (three ranks): the sums of the shards give the whole split's metrics.
    cuts = [(0, 10), (10, 60), (60, 101)]
    sharded = task.finish(_merge([task.sums(pred[a:b], y[a:b]) for a, b in cuts]))
    assert sharded == pytest.approx(whole, rel=1e-6)
    # An average of the shards' r2 would not be the split's r2: the reason the task sums.
    mean_of_r2 = sum(r2_score(y[a:b], pred[a:b]) for a, b in cuts) / len(cuts)
    assert abs(mean_of_r2 - whole["r2"]) > 1e-3


def test_classification_and_lm_keep_todays_loss_and_accuracy():
    g = torch.Generator().manual_seed(1)
    logits, y = torch.randn(40, 10, generator=g), torch.randint(0, 10, (40,), generator=g)
    got = tasks.Classification().finish(tasks.Classification().sums(logits, y))
    assert got["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, y).item(), rel=1e-6)
    assert got["accuracy"] == (logits.argmax(-1) == y).sum().item() / 40
    tokens, targets = torch.randn(4, 6, 32, generator=g), torch.randint(0, 32, (4, 6), generator=g)
    lm = tasks.LanguageModel()
    metrics = lm.finish(lm.sums(tokens, targets))
    assert metrics["perplexity"] == pytest.approx(torch.exp(lm.loss(tokens, targets)).item(), rel=1e-5)


def test_a_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"output \(8, 10\) does not match the targets \(8,\)"):
        tasks.Regression().loss(torch.zeros(8, 10), torch.zeros(8))
    with pytest.raises(ValueError, match=r"output \(8,\) does not match the targets \(8,\)"):
        tasks.Classification().loss(torch.zeros(8), torch.zeros(8, dtype=torch.long))


def test_a_users_task_is_checked_for_what_rayjobs_asks_of_it():
    task = tasks.build_task("user_model:huber_task", {"delta": 0.5})
    assert isinstance(task, tasks.Task) and task.delta == 0.5
    with pytest.raises(TypeError, match="without sums, finish"):
        tasks.build_task("user_model:half_task")
    with pytest.raises(TypeError, match=r"metric_objects\(\) must map names in metrics \('loss', 'r2'\) to "
                       r"torchmetrics.Metric objects; r2 is not"):  # fmt: skip
        tasks.build_task("user_model:not_a_metric_task")
    assert set(tasks.metric_objects(tasks.build_task("user_model:metric_objects_task"))) == {"r2", "mae"}


@pytest.mark.parametrize(
    "overrides, task, metric, mode",
    [
        ([], "classification", "val/accuracy", "max"),
        (["model.name=gpt", "data.name=synthetic", "data.kwargs.kind=tokens"], "lm", "val/loss", "min"),
        (["model.name=mlp", "data.name=diabetes"], "regression", "val/r2", "max"),
        (
            ["model.name=mlp", "data.name=diabetes", "tune.metric=val/mae", "tune.mode=min"],
            "regression",
            "val/mae",
            "min",
        ),
    ],
)
def test_auto_picks_the_task_from_the_data_and_the_metrics_follow_it(overrides, task, metric, mode):
    cfg = load_config(None, overrides)
    assert (cfg.task.name, cfg.tune.metric, cfg.tune.mode) == (task, metric, mode)
    again = load_config(None, [*overrides, f"task.name={task}"])  # the same when named
    assert (again.tune.metric, again.tune.mode) == (metric, mode)


def test_a_mode_left_unset_follows_its_metric():
    """A metric of known direction sets its mode: `checkpoint.metric=val/accuracy` alone kept the
    least accurate checkpoints (mode min), and `tune.metric=val/loss` picked the worst trial (max)."""
    cfg = load_config(None, ["checkpoint.metric=val/accuracy", "tune.metric=val/loss"])
    assert (cfg.checkpoint.mode, cfg.tune.mode) == ("max", "min")
    stop = load_config(None, ["training.early_stop.patience=2", "training.early_stop.metric=val/loss"])
    assert stop.training.early_stop.mode == "min"
    from types import SimpleNamespace

    from rayjobs.config import better_direction

    huber = SimpleNamespace(metric="within_half", mode="max")
    assert [better_direction(huber, m) for m in ("val/within_half", "train/loss", "val/mae", "val/f1")] == [
        "max",
        "min",
        "min",
        "",  # unknown: early stopping on it asks for a mode
    ]


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["task.name=regression"], "task.name: task regression needs real-valued targets, but data.name=digits "
         "gives integer class labels; pick a task for this data (or task.name=auto)"),
        (["task.name=clasification"], "task.name: unknown task 'clasification' (did you mean 'classification'?); "
         "known: classification | lm | regression (or package.module:callable)"),
        # A metric ranked backwards kept the worst checkpoints, or picked the worst trial, without a word.
        (["model.name=mlp", "data.name=diabetes", "tune.mode=min"], "tune.mode: min ranks val/r2 backwards (a "
         "higher r2 is better); set tune.mode=max"),
        (["tune.metric=val/loss", "tune.mode=max"], "tune.mode: max ranks val/loss backwards (a lower loss is "
         "better); set tune.mode=min"),
        (["checkpoint.metric=val/accuracy", "checkpoint.mode=min"], "checkpoint.mode: min ranks val/accuracy "
         "backwards (a higher accuracy is better); set checkpoint.mode=max"),
        (["model.name=mlp", "data.name=diabetes", "checkpoint.metric=val/accuracy"], "checkpoint.metric: task "
         "regression reports val/loss, val/mse, val/mae, val/r2, train/loss at every eval, not 'val/accuracy'"),
        (["data.name=user_model:two_things", "model.name=mlp"], "data.name: cannot load 'user_model:two_things': "
         "TypeError: user_model:two_things must return (train, val[, test]) torch Datasets, a dict of them, or "
         "rayjobs.data.Splits; got list"),
        (["data.name=user_model:sine_data", "data.kwargs.rowz=9", "model.name=mlp"], "data.kwargs.rowz: "
         "user_model:sine_data takes no argument 'rowz' (did you mean 'rows'?); allowed: rows, noise"),
        (["task.name=user_model:half_task"], "task.name: cannot build 'user_model:half_task': TypeError: "
         "user_model:half_task returned a Half without sums, finish (see rayjobs.tasks.Task)"),
    ],
)  # fmt: skip
def test_a_task_that_does_not_fit_is_one_line(overrides, line):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).splitlines() == [line]


def test_a_users_datasets_give_what_the_model_needs_to_know():
    from rayjobs import data

    splits = data.load("user_model:sine_data", {"rows": 100})
    assert (splits.info.kind, splits.info.input_shape, splits.info.num_classes, splits.info.targets) == (
        "image",
        (2,),
        1,
        "real",
    )
    assert (len(splits.train), len(splits.val), len(splits.test)) == (70, 15, 15)
    x, y = splits.train[0]
    classes = data.user_splits((torch.utils.data.TensorDataset(x.repeat(5, 1), torch.arange(5)),) * 2, "mine")
    assert (classes.info.num_classes, classes.info.targets, classes.test is classes.val) == (5, "class", True)
    seq = torch.arange(8)
    tokens = data.user_splits([torch.utils.data.TensorDataset(seq[None, :-1], seq[None, 1:])] * 2, "mine")
    assert (tokens.info.kind, tokens.info.num_classes) == ("tokens", 8)
    cfg = load_config(None, ["data.name=user_model:sine_data", "model.name=mlp"])
    assert (cfg.task.name, cfg.run.name) == ("regression", "mlp-sine_data")


def test_a_users_model_is_split_by_the_plan_its_builder_carries():
    from models import ParallelPlan, parallel_plan
    from rayjobs.parallel.apply import layout_problems

    assert isinstance(parallel_plan("user_model:user_gpt"), ParallelPlan)
    assert parallel_plan("user_model:user_gpt").tp_plan["layers.*.attn.q_proj"] == "colwise"
    tokens = ["data.name=synthetic", "data.kwargs={kind: tokens, seq_len: 16, vocab_size: 32}", "training.batch_size=8"]
    ok = load_config(None, ["model.name=user_model:user_gpt", "parallel.strategy=tp", *tokens])
    assert layout_problems(ok, 2, False) == []
    bare = load_config(None, ["model.name=user_model:build_tiny", "parallel.strategy=pp"])
    assert layout_problems(bare, 2, False) == [
        "parallel.strategy=pp: user_model:build_tiny carries no parallel plan for it; give the builder one: "
        "build_tiny.parallel_plan = models.ParallelPlan(layers_attr=..., tp_plan={...}, pipeline_first=(...), "
        "pipeline_last=(...))"
    ]
