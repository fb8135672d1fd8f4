"""`rayjobs predict`: batch inference of a checkpoint over Parquet rows with Ray Data actors."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import run_cli

from rayjobs import train
from rayjobs.checkpoint import load_for_inference
from rayjobs.config import load_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_predict_writes_one_prediction_per_row_equal_to_the_models(tmp_path):
    summary = train.run(
        load_config(
            None,
            [f"run.storage_path={tmp_path}", "scaling.num_workers=0", "model.name=mlp", "tracking.enabled=false",
             "training.epochs=3", "training.batch_size=32"],
        )
    )  # fmt: skip
    assert run_cli("data", "prepare", "digits", "--out", str(tmp_path / "digits"), timeout=120).returncode == 0
    rows = tmp_path / "digits" / "test"
    proc = run_cli("predict", summary["checkpoint"], "--data", str(rows), "--out", str(tmp_path / "preds"), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "predicted 270 rows (image) on 1 actor(s)" in proc.stdout
    got = pq.read_table(tmp_path / "preds").to_pandas().sort_values("label", kind="stable")
    source = pq.read_table(rows).to_pandas().sort_values("label", kind="stable")
    assert len(got) == len(source) == 270 and list(got.columns) == ["image", "label", "prediction"]
    model, _ = load_for_inference(summary["checkpoint"])
    for part in (got,):  # the model's own argmax, row by row (rows keep their features beside the prediction)
        x = torch.tensor(np.stack(part["image"].to_list()), dtype=torch.float32).reshape(-1, 1, 8, 8)
        assert (model(x).argmax(-1).numpy() == part["prediction"].to_numpy()).all()
    assert (got["prediction"] == got["label"]).mean() == pytest.approx(summary["metrics"]["test/accuracy"])

    again = run_cli("predict", summary["checkpoint"], "--data", str(rows), "--out", str(tmp_path / "preds"))
    assert (
        again.returncode == 2
        and again.stderr.strip()
        == f"rayjobs: error: predict: --out {tmp_path / 'preds'} is not empty; give a new directory"
    )
    wrong = run_cli(
        "predict", summary["checkpoint"], "--data", str(rows), "--out", str(tmp_path / "p"), "--features", "label"
    )
    assert wrong.returncode == 2 and "the model takes 64 values per row (input (1, 8, 8)), but label of" in wrong.stderr
    assert "RAY_IMPORTED=False" in wrong.stdout  # refused before Ray starts
