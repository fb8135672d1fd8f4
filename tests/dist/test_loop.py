"""The loop's math: gradient accumulation equals one large batch; LR schedules; local-mode runs."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from models import DataInfo, build_model
from rayjobs import stepping
from rayjobs.config import from_dict, load_config
from rayjobs.context import WorkerContext
from rayjobs.errors import ConfigError
from rayjobs.rundir import read_history

INFO = DataInfo(kind="image", input_shape=(1, 8, 8), num_classes=10)
CPU = WorkerContext(0, 1, 0, torch.device("cpu"))


def _batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


@pytest.mark.parametrize("accum", [2, 4, 8])
def test_grad_accumulation_equals_one_large_batch(accum: int):
    cfg = from_dict({"model": {"name": "mlp"}, "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.0}})
    torch.manual_seed(0)
    big = build_model("mlp", "debug", {}, INFO)
    small = copy.deepcopy(big)
    x, y = _batch(32)
    opt_big = torch.optim.SGD(big.parameters(), lr=0.1)
    opt_small = torch.optim.SGD(small.parameters(), lr=0.1)
    big_step = stepping.train_step(big, [(x, y)], opt_big, cfg, CPU)
    micro = list(zip(x.chunk(accum), y.chunk(accum)))
    small_step = stepping.train_step(small, micro, opt_small, cfg, CPU)
    loss_big, norm_big, loss_small, norm_small = (
        big_step.loss,
        big_step.grad_norm,
        small_step.loss,
        small_step.grad_norm,
    )
    assert loss_small == pytest.approx(loss_big, rel=1e-5)
    assert norm_small == pytest.approx(norm_big, rel=1e-5)
    for a, b in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_global_grad_norm_is_the_norm_of_all_gradients_together(dtype):
    """The fused per-group norm (one kernel per dtype) equals the fp64 norm of every gradient concatenated."""
    from rayjobs.parallel.apply import clip_grad_norm

    torch.manual_seed(0)
    model = build_model("mlp", "debug", {}, INFO).to(dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 3
    expected = torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm().item()
    assert float(clip_grad_norm(model, math.inf, None, lazy=True)) == pytest.approx(expected, rel=1e-5)
    assert clip_grad_norm(model, math.inf, None) == pytest.approx(expected, rel=1e-5)


def test_grad_clip_bounds_the_update():
    cfg = from_dict({"model": {"name": "mlp"}, "optim": {"name": "sgd", "lr": 1.0, "momentum": 0.0, "grad_clip": 0.01}})
    torch.manual_seed(0)
    model = build_model("mlp", "debug", {}, INFO)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    norm = stepping.train_step(model, [_batch(16)], torch.optim.SGD(model.parameters(), lr=1.0), cfg, CPU).grad_norm
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert norm > 0.01
    assert (after - before).norm().item() == pytest.approx(0.01, rel=1e-4)


@pytest.mark.parametrize("clip", [0.01, 0.0])
def test_a_lean_step_updates_the_weights_exactly_as_a_checked_one(clip: float):
    """The lean step (no host sync) and the checked step give the same weights, loss and gradient norm,
    with a clip that binds (applied on the device) and with none."""
    cfg = from_dict({"model": {"name": "mlp"}, "optim": {"name": "adamw", "lr": 0.01, "grad_clip": clip}})
    torch.manual_seed(0)
    checked = build_model("mlp", "debug", {}, INFO)
    lean = copy.deepcopy(checked)
    opts = [stepping.build_optimizer(m, cfg) for m in (checked, lean)]
    window = stepping.LossWindow()
    for step in range(1, 4):
        batch = [_batch(16, seed=step)]
        a = stepping.train_step(checked, batch, opts[0], cfg, CPU)
        b = stepping.train_step(lean, batch, opts[1], cfg, CPU, lean=True)
        assert b.pending is not None and isinstance(b.pending[0], torch.Tensor)
        window.add(step, b)
    settled, loss_sum = window.check(CPU)
    assert settled.finite and settled.loss == a.loss and settled.grad_norm == pytest.approx(a.grad_norm, rel=1e-12)
    assert len(window) == 0 and loss_sum > 0
    for x, y in zip(checked.parameters(), lean.parameters()):
        assert torch.equal(x, y)


def _lean_worker(rank: int, world: int, port: int, out: str) -> None:
    """Lean steps on 2 DDP ranks, counting host syncs and Python collectives; rank 1's loss is NaN at step 3."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    ctx = WorkerContext.from_process_group()
    cfg = from_dict({"model": {"name": "mlp"}, "optim": {"name": "sgd", "lr": 0.1, "grad_clip": 1.0}})
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model("mlp", "debug", {}, INFO))
    opt = stepping.build_optimizer(model, cfg)
    counts = {"sync": 0, "collective": 0}

    def counting(fn, key):
        def wrapped(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        return wrapped

    torch.Tensor.item = counting(torch.Tensor.item, "sync")
    torch.Tensor.tolist = counting(torch.Tensor.tolist, "sync")
    torch.Tensor.__float__ = counting(torch.Tensor.__float__, "sync")
    dist.all_reduce = counting(dist.all_reduce, "collective")
    window, seen = stepping.LossWindow(), {}
    for step in range(1, 5):
        nan = rank == 1 and step == 3  # rank 1's loss is NaN at step 3; DDP spreads it to rank 0 at step 4
        batch = [_batch(8, seed=10 * step + rank)]
        window.add(step, stepping.train_step(model, batch, opt, cfg, ctx, inject_nan=nan, lean=True))
        if step == 2:
            seen["after_2_steps"] = dict(counts)
            result, loss_sum = window.check(ctx)
            seen["first"] = {"finite": result.finite, "loss": result.loss, "loss_sum": loss_sum}
    result, _ = window.check(ctx)
    seen["second"] = {"finite": result.finite, "at_step": result.at_step, "ranks": result.bad_ranks}
    seen["after_checks"] = dict(counts)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(seen, f)


def test_lean_steps_wait_for_nothing_and_a_check_finds_the_first_non_finite_step_and_rank(tmp_path):
    """Lean steps on 2 DDP ranks make no host sync and no collective of the loop's own (DDP's gradient
    all-reduce is its own, in C++); each check is one all-reduce that names the first bad step and rank."""
    from conftest import spawn_ranks

    spawn_ranks(_lean_worker, 2, (str(tmp_path / "lean.json"),))
    seen = json.loads((tmp_path / "lean.json").read_text())
    assert seen["after_2_steps"] == {"sync": 0, "collective": 0}
    assert seen["first"]["finite"] and seen["first"]["loss"] > 0
    assert seen["first"]["loss_sum"] > seen["first"]["loss"]  # two steps' replica means
    assert seen["second"] == {"finite": False, "at_step": 3, "ranks": [1]}
    assert seen["after_checks"]["collective"] == 2


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_lr_schedules_warm_up_then_follow_their_shape(schedule: str):
    cfg = from_dict({"optim": {"schedule": schedule, "warmup_steps": 10}})
    factors = [stepping.lr_factor(s, cfg, 110) for s in range(110)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0)
    if schedule == "constant":
        assert factors[-1] == 1.0
    else:
        assert factors[-1] < 0.05 and all(a >= b for a, b in zip(factors[10:], factors[11:]))
    if schedule == "cosine":
        assert factors[60] == pytest.approx(0.5, abs=0.01)


def test_micro_batch_size_must_divide():
    assert stepping.micro_batch_size(64, 2, 4) == 8
    with pytest.raises(ValueError, match="multiple of workers x grad_accum = 6"):
        stepping.micro_batch_size(64, 2, 3)


def test_local_mode_trains_digits_and_loss_goes_down(tmp_path):
    """The real driver in Ray Train's local mode (num_workers=0): no Ray processes, same loop."""
    from rayjobs import train

    cfg = load_config(
        None,
        [
            f"run.storage_path={tmp_path}",
            "scaling.num_workers=0",
            "model.name=mlp",
            "training.epochs=3",
            "training.eval_every=10",
            "training.batch_size=32",
        ],
    )
    summary = train.run(cfg)
    m = summary["metrics"]
    assert summary["num_workers"] == 0 and summary["mlflow_run_id"]
    assert m["step"] == 3 * (1257 // 32)
    assert m["test/accuracy"] > 0.9 and m["train/loss"] < 0.5
    history = [h for h in read_history(summary["history"]) if "val/loss" in h]
    assert [h["step"] for h in history] == [*range(10, 111, 10), 117]
    assert history[0]["train/loss"] > history[-1]["train/loss"]
    assert summary["checkpoint"].endswith(f"checkpoint_{m['step']:08d}")
    train.write_summary(summary, str(tmp_path / "s.json"))
    assert json.loads((tmp_path / "s.json").read_text())["run_name"] == "mlp-digits"  # not the file's digits-ddp


def test_max_steps_caps_training_and_bf16_runs_on_cpu(tmp_path):
    from rayjobs import train

    cfg = load_config(
        None,
        [
            f"run.storage_path={tmp_path}",
            "scaling.num_workers=0",
            "model.name=gpt",
            "model.flavor=debug",
            "data.name=synthetic",
            "data.kwargs.kind=tokens",
            "data.kwargs.seq_len=16",
            "data.kwargs.num_samples=256",
            "training.max_steps=7",
            "training.batch_size=8",
            "training.grad_accum=2",
            "training.precision=bf16",
        ],
    )
    m = train.run(cfg)["metrics"]
    assert m["step"] == 7 and m["val/loss"] == m["val/loss"]  # finite, not NaN


def test_a_users_task_trains_in_local_mode_and_mlflow_holds_its_metric(tmp_path):
    """`task.name: module:callable` (tests/user_model.py, outside rayjobs): its loss is trained, its
    metrics are evaluated, reported, summarized and logged to MLflow."""
    import mlflow

    from rayjobs import train

    cfg = load_config(
        "regression-diabetes",
        [f"run.storage_path={tmp_path}", "scaling.num_workers=0", "task.name=user_model:huber_task"],
    )
    assert (cfg.tune.metric, cfg.tune.mode) == ("val/within_half", "max")
    summary = train.run(cfg)
    m = summary["metrics"]
    assert m["test/within_half"] > 0.3 and m["val/mae"] < 0.7, m
    history = [h for h in read_history(summary["history"]) if "val/within_half" in h]
    assert [h["step"] for h in history] == [90, 180, 270, 360]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    logged = mlflow.get_run(summary["mlflow_run_id"]).data.metrics
    assert logged["val/within_half"] == pytest.approx(history[-1]["val/within_half"])
    assert "test/within_half" in logged


def _regression_eval_worker(rank: int, world: int, port: int, out: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from user_model import metric_objects_task

    from rayjobs import tasks
    from rayjobs.data import diabetes

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    cfg = from_dict({"model": {"name": "mlp"}, "data": {"name": "diabetes"}, "training": {"batch_size": 8}})
    ctx = WorkerContext.from_process_group()
    got = stepping.evaluate(model, diabetes().val, cfg, ctx, "val", task=tasks.Regression())
    got.update(stepping.evaluate(model, diabetes().val, cfg, ctx, "tm", task=metric_objects_task()))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(got, f)


def test_regression_metrics_over_two_ranks_equal_one_process(tmp_path):
    """Each rank evaluates its strided share; the task's sums are all-reduced: r2 of the whole split."""
    from conftest import spawn_ranks

    from rayjobs import tasks
    from rayjobs.data import diabetes

    spawn_ranks(_regression_eval_worker, 2, (str(tmp_path / "two.json"),))
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    cfg = from_dict({"model": {"name": "mlp"}, "data": {"name": "diabetes"}})
    one = stepping.evaluate(model, diabetes().val, cfg, CPU, "val", task=tasks.Regression())
    assert set(one) == {"val/loss", "val/mse", "val/mae", "val/r2"}
    # A user's task whose metrics are torchmetrics objects: torchmetrics syncs them over the ranks.
    one.update(
        stepping.evaluate(
            model, diabetes().val, cfg, CPU, "tm", task=tasks.build_task("user_model:metric_objects_task")
        )
    )
    two = json.loads((tmp_path / "two.json").read_text())
    assert two == pytest.approx(one, rel=1e-6)  # float32 batch sums, other batch sizes
    assert {k: one[f"tm/{k}"] for k in ("loss", "r2", "mae")} == pytest.approx(
        {k: one[f"val/{k}"] for k in ("loss", "r2", "mae")}, rel=1e-5
    )  # torchmetrics' R2Score and MAE agree with the shipped sums


def _early(tmp_path, name: str, *extra: str):
    return load_config(
        "regression-diabetes",
        [
            f"run.storage_path={tmp_path}",
            f"run.name={name}",
            "scaling.num_workers=0",
            "training.eval_every=9",
            "checkpoint.every_steps=9",
            "training.early_stop.patience=3",
            *extra,
        ],
    )


def test_early_stop_ends_a_plateaued_run_and_says_why_everywhere_even_across_a_resume(tmp_path):
    """training.early_stop: the task's metric (val/r2, max) watched at every eval; the run ends after
    `patience` evals without improvement, with test metrics and a final checkpoint; the reason is in
    the console, the summary and MLflow. A crash before it and a resume stop at the same step."""
    import mlflow

    from rayjobs import train
    from rayjobs.errors import TrainingFailed

    cfg = _early(tmp_path, "plateau")
    assert (cfg.training.early_stop.metric, cfg.training.early_stop.mode) == ("val/r2", "max")
    summary = train.run(cfg)
    m, stopped = summary["metrics"], int(summary["metrics"]["early_stop/step"])
    assert stopped == m["step"] < 360 and stopped % 9 == 0, m
    assert summary["checkpoint"].endswith(f"checkpoint_{stopped:08d}") and "test/r2" in m
    r2 = [h["val/r2"] for h in read_history(summary["history"]) if "val/r2" in h]
    assert max(r2[-4:-1]) <= max(r2[:-3]) and max(r2) == pytest.approx(m["early_stop/best"])  # 3 evals, no gain
    assert summary["early_stop"] == (
        f"stopped early at step {stopped}: val/r2 did not beat its best {m['early_stop/best']:.4f} (max) by more "
        "than 0 for 3 eval(s)"
    )
    assert summary["early_stop"] in train.format_summary(summary)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert mlflow.get_run(summary["mlflow_run_id"]).data.tags["rayjobs.early_stop"] == summary["early_stop"]

    crash = f"faults.raise_at_step={stopped - 10}"  # after the best, before the stop: the count must survive
    with pytest.raises(TrainingFailed):
        train.run(_early(tmp_path, "crashy", crash))
    resumed = train.run(_early(tmp_path, "crashy", crash))
    assert resumed["metrics"]["early_stop/step"] == stopped
    assert resumed["metrics"]["early_stop/best"] == m["early_stop/best"]


def test_a_warm_start_from_a_registered_model_starts_at_its_accuracy(tmp_path):
    """model.init_from=models:/NAME/VERSION: the registered run's weights, a fresh optimizer and step 0,
    at any world size; evaluated before step 1; the MLflow run says where the weights came from. A
    mismatched model or an unknown source is one line before anything runs."""
    import mlflow

    from rayjobs import train
    from rayjobs.rundir import RunDir

    base = [f"run.storage_path={tmp_path}", "scaling.num_workers=0", "model.name=mlp", "training.batch_size=32"]
    first = train.run(
        load_config(None, [*base, "run.name=teacher", "training.epochs=3", "tracking.register_as=digits-mlp"])
    )
    assert first["metrics"]["test/accuracy"] >= 0.95
    # Logging and registering the model left this process's environment as it was (no
    # MLFLOW_TRACKING_URI for a later child process, such as `rayjobs eval models:/...`, to inherit).
    assert "MLFLOW_TRACKING_URI" not in os.environ
    cfg = load_config(None, [*base, "run.name=student", "training.epochs=1", "model.init_from=models:/digits-mlp/1",
                                       "tracking.register_as=digits-mlp"])  # fmt: skip
    summary = train.run(cfg)
    started = RunDir(str(tmp_path / "student")).read_events("warm_start")
    assert len(started) == 1 and started[0]["val/accuracy"] >= 0.95, started
    assert started[0]["checkpoint"] == first["checkpoint"]
    assert summary["metrics"]["step"] == 1257 // 32  # step 0 and one whole epoch: not a resume
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert mlflow.get_run(summary["mlflow_run_id"]).data.tags["rayjobs.init_from"] == "models:/digits-mlp/1"

    # `latest` (and no version at all) is the highest version, as in MLflow (the student registered
    # version 2); a stage name is one line.
    from rayjobs.preflight import mlflow_checkpoint

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert mlflow_checkpoint(uri, "models:/digits-mlp/1", "eval") == first["checkpoint"]
    for source in ("models:/digits-mlp/latest", "models:/digits-mlp"):
        assert mlflow_checkpoint(uri, source, "eval") == summary["checkpoint"], source
    with pytest.raises(ConfigError, match=r"^eval: models:/digits-mlp/Production: a model version is a number or"):
        mlflow_checkpoint(uri, "models:/digits-mlp/Production", "eval")
    with pytest.raises(
        ConfigError, match=r"^eval: models:/nope/latest not found in .*no registered model named 'nope'"
    ):
        mlflow_checkpoint(uri, "models:/nope/latest", "eval")

    for extra, line in [
        (["model.flavor=debug"], "model.init_from: models:/digits-mlp/1 holds mlp/default {}, but this run builds "
         "mlp/debug {}: warm-start the same model"),
        (["model.init_from=models:/nope/1"], "model.init_from: models:/nope/1 not found in "),
        ([f"model.init_from={tmp_path / 'none'}"], f"model.init_from: no checkpoint directory at {tmp_path / 'none'}"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as err:
            train.run(load_config(None, [*base, "run.name=other", "model.init_from=models:/digits-mlp/1", *extra]))
        assert str(err.value).startswith(line) and "\n" not in str(err.value), str(err.value)
