"""`rayjobs predict`: batch inference of a checkpoint over Parquet rows with Ray Data actors."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import run_cli

from rayjobs import launch, train
from rayjobs.checkpoint import load_for_inference
from rayjobs.config import load_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_predict_writes_one_prediction_per_row_equal_to_the_models(tmp_path):
    assert run_cli("data", "prepare", "digits", "--out", str(tmp_path / "digits"), timeout=120).returncode == 0
    summary = train.run(  # local mode over the Parquet shards: Ray Data reads them in a Ray of the run's own
        load_config(
            None,
            [f"run.storage_path={tmp_path}", "scaling.num_workers=0", "model.name=mlp", "tracking.enabled=false",
             "training.epochs=3", "training.batch_size=32", "data.name=parquet", f"data.kwargs.path={tmp_path / 'digits'}"],
        )
    )  # fmt: skip
    # Not Ray Data's own `ray.init()`, which joined a `ray start` cluster on the machine or took the
    # dashboard port 8265 that `rayjobs cluster up` then refused.
    assert launch.owns_local_ray() and summary["launch"]["launch/ray_s"] > 0.5, summary["launch"]
    import ray

    assert not ray.worker.global_worker.node.address_info["webui_url"].endswith(":8265")
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
    header_only = tmp_path / "header.csv"
    header_only.write_text(",".join(f"p{i}" for i in range(64)) + "\n")
    empty = run_cli("predict", summary["checkpoint"], "--data", str(header_only), "--out", str(tmp_path / "e"))
    assert empty.returncode == 2 and empty.stderr.strip() == (
        f"rayjobs: error: predict: {header_only} holds no rows (a header only?); give data with rows to predict"
    )
    nowhere = run_cli("predict", summary["checkpoint"], "--data", str(rows), "--out", "/proc/no-such/preds")
    assert nowhere.returncode == 2 and "predict: --out: cannot create /proc/no-such/preds" in nowhere.stderr
    exported = run_cli("export", summary["checkpoint"], "--out", "/proc/no-such/w.pt")
    assert exported.returncode == 2 and "export: --out: cannot create /proc/no-such" in exported.stderr
    (tmp_path / "file.csv").write_text("not a directory")
    onto_a_file = run_cli("predict", summary["checkpoint"], "--data", str(rows), "--out", str(tmp_path / "file.csv"))
    assert onto_a_file.returncode == 2 and onto_a_file.stderr.strip().startswith(
        f"rayjobs: error: predict: --out {tmp_path / 'file.csv'} is a file; give a new directory"
    ), onto_a_file.stderr[-2000:]
    (tmp_path / "dir.pt").mkdir()
    onto_a_dir = run_cli("export", summary["checkpoint"], "--out", str(tmp_path / "dir.pt"))
    assert onto_a_dir.returncode == 2 and onto_a_dir.stderr.strip().startswith(
        f"rayjobs: error: export: --out {tmp_path / 'dir.pt'} is a directory; give a file path"
    ), onto_a_dir.stderr[-2000:]
    for proc in (empty, nowhere, exported, onto_a_file, onto_a_dir):
        assert "Traceback" not in proc.stderr and "RAY_IMPORTED=False" in proc.stdout


def test_predict_gives_a_language_models_next_token_for_each_row(tmp_path):
    """A gpt trained on prepared text: each row's prediction is the model's most likely next token
    after the row's last seq_len tokens (rows of 33 tokens, a model of 32 positions)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "doc.txt").write_text("the quick fox jumps over the lazy dog.\n" * 200)
    prepared = tmp_path / "tokens"
    done = run_cli("data", "prepare", "text", str(corpus), "--out", str(prepared), "--seq-len", "32", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = train.run(
        load_config(
            None,
            [f"run.storage_path={tmp_path}", "scaling.num_workers=0", "model.name=gpt", "model.flavor=debug",
             "data.name=parquet", f"data.kwargs.path={prepared}", "training.max_steps=30", "optim.lr=0.01",
             "training.batch_size=16", "tracking.enabled=false"],
        )
    )  # fmt: skip
    rows = prepared / "val"
    proc = run_cli("predict", summary["checkpoint"], "--data", str(rows), "--out", str(tmp_path / "p"), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got = pq.read_table(tmp_path / "p").to_pandas()
    source = pq.read_table(rows).to_pandas()
    assert len(got) == len(source) > 0 and list(got.columns) == ["tokens", "prediction"]
    model, _ = load_for_inference(summary["checkpoint"])
    x = torch.tensor(np.stack(got["tokens"].to_list())[:, -32:], dtype=torch.long)
    assert (model(x)[:, -1].argmax(-1).numpy() == got["prediction"].to_numpy()).all()
    assert got["prediction"].between(0, 255).all() and got["prediction"].nunique() > 1

    wrong = run_cli("predict", summary["checkpoint"], "--data", str(rows), "--out", str(tmp_path / "q"),
                    "--features", "tokens,tokens")  # fmt: skip
    assert wrong.returncode == 2 and "a language model reads one Parquet column of token ids" in wrong.stderr
