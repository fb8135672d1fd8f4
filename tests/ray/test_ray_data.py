"""Ray Data ingest on a real local Ray (shared by this module): small evaluation splits are read once;
a text corpus trains gpt, and a crash inside an epoch resumes. (Parquet digits training like the bundled
digits, and a transformers model under FSDP on text, are checked on the README's own commands in
tests/test_readme.py.)"""

from __future__ import annotations

import pytest
from conftest import run_cli

from rayjobs import train
from rayjobs.config import load_config
from rayjobs.errors import TrainingFailed
from rayjobs.rundir import read_history

pytestmark = pytest.mark.ray


def _prepare(*args: str) -> None:
    proc = run_cli("data", "prepare", *args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_small_evaluation_splits_are_read_once_for_all_workers(ray_cluster, tmp_path):
    """Each worker reads all of val and test: read in the driver once, not once per worker per split."""
    from ray.data.dataset import MaterializedDataset

    from rayjobs import ray_data

    _prepare("digits", "--out", str(tmp_path / "digits"))
    kwargs = {"path": str(tmp_path / "digits")}
    source = ray_data.resolve("parquet", kwargs)
    assert ray_data.fits_in_memory(source, world_size=2)
    read = ray_data.read_evaluation_splits_once(ray_data.datasets(source, kwargs))
    assert not isinstance(read["train"], MaterializedDataset)  # train streams, split over the workers
    assert isinstance(read["val"], MaterializedDataset) and isinstance(read["test"], MaterializedDataset)
    assert (read["val"].count(), read["test"].count()) == (270, 270)
    assert sorted(read["val"].take_batch(1, batch_format="numpy")) == ["x", "y"]


def _corpus(folder, docs: int = 3, repeats: int = 40) -> None:
    folder.mkdir()
    lines = [
        f"the {a} {b} jumps over the lazy {c}.\n"
        for a in ("quick", "slow")
        for b in ("fox", "cat")
        for c in ("dog", "cow")
    ]
    for i in range(docs):
        (folder / f"doc{i}.txt").write_text("".join(lines * repeats))


def test_a_text_corpus_trains_gpt_and_resumes_inside_an_epoch(ray_cluster, tmp_path):
    _corpus(tmp_path / "train")
    # 46 validation rows: evaluated every 10 steps, a validation split as large as the training one
    # cost 7 times the training itself.
    _corpus(tmp_path / "val", docs=1, repeats=5)
    sets = [
        f"run.storage_path={tmp_path}",
        "run.name=text",
        "model.name=gpt",
        "model.flavor=debug",
        "data.name=text",
        f"data.kwargs={{path: {tmp_path / 'train'}, val_path: {tmp_path / 'val'}, seq_len: 32}}",
        "optim.lr=0.01",
        "training.batch_size=16",
        "training.epochs=2",
        "training.eval_every=10",
        "checkpoint.every_steps=10",
        "scaling.num_workers=1",
        "tracking.enabled=false",
    ]
    with pytest.raises(TrainingFailed, match="raise_at_step=25"):
        train.run(load_config(None, [*sets, "faults.raise_at_step=25"]))
    summary = train.run(load_config(None, sets))  # the same run again: resumes at step 20
    rows = 3 * ((tmp_path / "train" / "doc0.txt").stat().st_size // 33)  # byte tokens, 32 + 1 per row
    steps_per_epoch = rows // 16
    assert summary["metrics"]["step"] == 2 * steps_per_epoch
    history = read_history(summary["history"])
    evals = [h for h in history if "val/loss" in h]
    assert evals[0]["step"] == 10 and evals[-1]["val/loss"] < 0.6 * evals[0]["val/loss"], evals
    assert [h["step"] for h in evals] == sorted({h["step"] for h in evals})  # no step twice after the resume


def test_no_cpu_left_for_ray_data_is_said_before_training(ray_cluster, capfd):
    """Workers that take every CPU would starve Ray Data's read tasks: the driver says so, and how to fix it."""
    from rayjobs.launch import init_ray
    from rayjobs.plan import ScalingPlan

    init_ray(ScalingPlan(2, False, {"CPU": 1.0}), streaming=True)
    err = capfd.readouterr().err
    assert "2 CPU(s) with 2 taken by the workers" in err and "scaling.resources_per_worker.CPU" in err
    init_ray(ScalingPlan(2, False, {"CPU": 0.5}), streaming=True)
    assert "Ray Data" not in capfd.readouterr().err
