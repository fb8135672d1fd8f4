"""Checkpoints under Ray Train with 2 workers: a worker killed hard resumes bit-identical; 2 -> 1 workers; NaN."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import checkpoint_weights

from rayjobs import checkpoint as ckpt
from rayjobs import train
from rayjobs.config import load_config
from rayjobs.errors import TrainingFailed
from rayjobs.rundir import RunDir, read_history

pytestmark = pytest.mark.ray

BASE = [
    "scaling.num_workers=2",
    "training.epochs=2",
    "training.eval_every=10",
    "checkpoint.every_steps=10",
    "checkpoint.keep_last=5",
]
STEPS = 2 * (1257 // 64)  # 38


def cfg_for(root: Path, name: str, *extra: str):
    return load_config(None, [*BASE, f"run.storage_path={root}", f"run.name={name}", *extra])


weights = checkpoint_weights


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-ckpt")
    reference = train.run(cfg_for(root, "reference"))
    # Rank 1 dies hard (SIGKILL) at step 25, inside epoch 2; Ray Train restarts the worker group.
    killed = train.run(
        cfg_for(root, "killed", "faults.kill_rank=1", "faults.kill_at_step=25", "failure.max_failures=1")
    )
    return root, reference, killed


def test_worker_killed_hard_resumes_bit_identical(runs):
    root, reference, killed = runs
    assert (root / "killed" / ".faults" / "kill_rank1_step25").exists()  # the fault did fire
    assert killed["metrics"]["step"] == reference["metrics"]["step"] == STEPS
    a, b = weights(reference["checkpoint"]), weights(killed["checkpoint"])
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ref = {h["step"]: h for h in read_history(reference["history"])}
    new = {h["step"]: h for h in read_history(killed["history"])}
    for step in (30, STEPS):  # reports after the resume point (step 20)
        assert new[step]["train/loss"] == ref[step]["train/loss"] and new[step]["val/loss"] == ref[step]["val/loss"]


def test_two_worker_checkpoint_resumes_on_one_worker(runs, tmp_path, capfd):
    root, reference, _ = runs
    source = root / "reference" / ckpt.name_for(20)
    summary = train.run(
        load_config(
            None,
            [
                "scaling.num_workers=0",
                "training.epochs=2",
                f"run.storage_path={tmp_path}",
                "run.name=one",
                f"checkpoint.resume_from={source}",
            ],
        )
    )
    out = capfd.readouterr().out
    assert f"resumed from {source} at step 20" in out
    assert (
        "written by 2 worker(s), this run has 1: DCP resharded the model and optimizer; the global batch stays 64"
        in out
    )
    assert summary["metrics"]["step"] == STEPS
    assert summary["metrics"]["test/accuracy"] > 0.9


def test_nan_on_one_rank_stops_every_rank_at_that_step(ray_cluster, tmp_path):
    started = time.monotonic()
    with pytest.raises(TrainingFailed) as info:
        train.run(cfg_for(tmp_path, "nan", "faults.nan_rank=1", "faults.nan_at_step=7"))
    assert time.monotonic() - started < 120
    message = str(info.value)
    assert "non-finite loss at step 7 on rank(s) 1; every rank stopped without saving it" in message
    assert ckpt.latest_complete(tmp_path / "nan") is None  # nothing after the NaN was saved


def test_a_users_task_and_data_resume_bit_identical_after_a_worker_kill(ray_cluster, tmp_path):
    """tests/user_model.py's map-style data and Huber task (its own metric) on 2 DDP workers: rank 1
    killed hard at step 25 resumes from step 20 to the same weights and the same metric values."""
    user = [
        "model.name=mlp",
        "model.kwargs={hidden: 32, depth: 2}",
        "data.name=user_model:sine_data",
        "task.name=user_model:huber_task",
        "training.epochs=3",
        "training.batch_size=32",
        "tracking.enabled=false",
    ]
    steps = 3 * (358 // 32)  # 33
    reference = train.run(cfg_for(tmp_path, "user-ref", *user))
    killed = train.run(
        cfg_for(
            tmp_path, "user-killed", *user, "faults.kill_rank=1", "faults.kill_at_step=25", "failure.max_failures=1"
        )
    )
    assert (tmp_path / "user-killed" / ".faults" / "kill_rank1_step25").exists()
    assert killed["metrics"]["step"] == reference["metrics"]["step"] == steps
    a, b = weights(reference["checkpoint"]), weights(killed["checkpoint"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ref = {h["step"]: h for h in read_history(reference["history"])}
    new = {h["step"]: h for h in read_history(killed["history"])}
    for step in (30, steps):
        assert new[step]["val/within_half"] == ref[step]["val/within_half"], (new[step], ref[step])
        assert new[step]["train/loss"] == ref[step]["train/loss"]
    assert killed["metrics"]["test/within_half"] == reference["metrics"]["test/within_half"]


def test_a_two_worker_checkpoint_warm_starts_one_worker_at_its_accuracy(runs, tmp_path, capfd):
    """model.init_from across world sizes: the 2-worker run's weights (DCP reshards them) start a
    1-worker run at step 0 with a fresh optimizer, at the accuracy they had."""
    _, reference, _ = runs
    summary = train.run(
        load_config(
            None,
            ["scaling.num_workers=0", f"run.storage_path={tmp_path}", "run.name=warm", "training.max_steps=1",
             f"model.init_from={reference['checkpoint']}", "tracking.enabled=false"],
        )
    )  # fmt: skip
    out = capfd.readouterr().out
    line = next(s for s in out.splitlines() if "warm start from" in s)
    assert f"(step {STEPS} of its run)" in line, line
    (event,) = RunDir(str(tmp_path / "warm")).read_events("warm_start")  # the printed line is rounded
    assert event["val/accuracy"] == pytest.approx(reference["metrics"]["val/accuracy"], abs=1e-12), event
    assert event["val/accuracy"] >= 0.95
    assert summary["metrics"]["step"] == 1
