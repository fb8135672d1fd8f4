"""Streamed data with tracking on (the default): each format ends with a FINISHED MLflow run that
holds the final model, its signature taken from one batch of the stream; a search over Parquet
with Optuna runs to the end. One local Ray for the module; the runs use local mode where Ray
Train itself is not what is tested."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import run_cli

from rayjobs import train, tune
from rayjobs.config import load_config
from rayjobs.rundir import RunDir
from rayjobs.tracking import MODEL_URI_TAG, client, tracking_uri

pytestmark = pytest.mark.ray


def _csv_folders(root) -> dict:
    rng = np.random.default_rng(0)
    for split, n in (("train", 256), ("val", 64)):
        (root / split).mkdir(parents=True)
        x = rng.normal(size=(n, 4))
        y = (x[:, 0] + x[:, 1] > 0).astype(int)
        rows = ["a,b,c,d,label", *(",".join(f"{v:.4f}" for v in xi) + f",{yi}" for xi, yi in zip(x, y))]
        (root / split / "part.csv").write_text("\n".join(rows) + "\n")
    return {"data.name": "csv", "data.kwargs": f"{{path: {root}, num_classes: 2}}", "model.name": "mlp"}


def _image_folders(root) -> dict:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 48), ("val", 16)):
        for label, level in (("dark", 40), ("light", 215)):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = np.clip(rng.normal(level, 20, size=(8, 8)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels, mode="L").save(folder / f"{i}.png")
    kwargs = f"{{path: {root / 'train'}, val_path: {root / 'val'}, size: [8, 8]}}"
    return {"data.name": "images", "data.kwargs": kwargs, "model.name": "mlp"}


def _text_files(root) -> dict:
    for split in ("train", "val"):
        (root / split).mkdir(parents=True)
        (root / split / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    kwargs = f"{{path: {root / 'train'}, val_path: {root / 'val'}, seq_len: 32}}"
    return {"data.name": "text", "data.kwargs": kwargs, "model.name": "gpt", "model.flavor": "debug"}


@pytest.mark.parametrize("make", [_csv_folders, _image_folders, _text_files], ids=["csv", "images", "text"])
def test_a_streamed_run_with_tracking_ends_finished_with_its_model(ray_cluster, tmp_path, make):
    sets = make(tmp_path / "data")
    cfg = load_config(
        None,
        [
            f"run.storage_path={tmp_path / 'results'}",
            "scaling.num_workers=0",
            "training.epochs=2",
            "training.batch_size=16",
            *(f"{k}={v}" for k, v in sets.items()),
        ],
    )
    summary = train.run(cfg)
    run = client(tracking_uri(cfg)).get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert "val/loss" in run.data.metrics
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(cfg))
    info = mlflow.models.get_model_info(run.data.tags[MODEL_URI_TAG])
    inputs = info.signature.inputs.to_dict()[0]
    shape = {"csv": [-1, 4], "images": [-1, 1, 8, 8], "text": [-1, 32]}[sets["data.name"]]
    assert list(inputs["tensor-spec"]["shape"]) == shape, inputs


def test_a_search_over_parquet_with_optuna_runs_to_the_end(ray_cluster, tmp_path):
    proc = run_cli("data", "prepare", "digits", "--out", str(tmp_path / "digits"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = load_config(
        "tune-digits",
        [
            f"run.storage_path={tmp_path / 'results'}",
            "data.name=parquet",
            f"data.kwargs.path={tmp_path / 'digits'}",
            "training.epochs=1",
            "training.eval_every=0",
            "tune.search=optuna",
            "tune.scheduler=fifo",
            "tune.num_samples=2",
            "tune.max_concurrent_trials=1",
            "tracking.register_as=",
        ],
    )
    summary = tune.run_search(cfg)
    trials = summary["trials"]
    assert len(trials) == 2 and all(t["status"] == "done" for t in trials), json.dumps(trials, default=str)[:2000]
    assert len({json.dumps(t["config"], sort_keys=True) for t in trials}) == 2  # Optuna sampled two configs
    assert summary["best_metrics"]["val/accuracy"] > 0.5
    # FIFO, one trial at a time: the second trial ran in the first one's driver process (reuse_actors).
    starts = [RunDir(os.path.join(tune.layout_for(cfg)["train_storage"], t["id"])) for t in trials]
    assert len({s.read_events("trial_start")[0]["pid"] for s in starts}) == 1
