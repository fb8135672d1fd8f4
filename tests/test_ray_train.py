"""The real driver on a real local Ray cluster (shared by this module): 2 DDP workers train digits."""

from __future__ import annotations

import json

import pytest
from conftest import checkpoint_weights

from rayjobs import train
from rayjobs.config import load_config

pytestmark = pytest.mark.ray


def test_two_workers_train_digits_and_the_loss_goes_down(ray_cluster, tmp_path):
    cfg = load_config(
        None,
        [
            f"run.storage_path={tmp_path}",
            "run.name=ray-digits",
            "scaling.num_workers=2",
            "training.epochs=4",
            "training.eval_every=10",
        ],
    )
    summary = train.run(cfg)
    m = summary["metrics"]
    assert summary["num_workers"] == 2 and summary["device"] == "cpu"
    assert m["step"] == 4 * (1257 // 64)
    assert m["test/accuracy"] >= 0.9, m
    assert m["train/loss"] < 0.5 and m["val/loss"] < 1.0

    # Every report reached the driver's history: the first report's loss is far above the last one.
    history = [h for h in train.read_history(summary["history"]) if "val/loss" in h]
    assert [h["step"] for h in history] == [10, 20, 30, 40, 50, 60, 70, 76]
    assert history[0]["train/loss"] > 2 * history[-1]["train/loss"], history

    # The final checkpoint lives in the run's storage and loads without pickled code.
    assert summary["checkpoint"].startswith(str(tmp_path / "ray-digits"))
    weights = checkpoint_weights(summary["checkpoint"])
    assert weights["head.4.weight"].shape == (10, 128)

    train.write_summary(summary, str(tmp_path / "summary.json"))
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert {"run_name", "storage_path", "checkpoint", "mlflow_run_id", "wall_s", "samples_per_s", "metrics"} <= set(
        saved
    )
    assert saved["metrics"]["test/accuracy"] == m["test/accuracy"]
