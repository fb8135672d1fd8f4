"""A Parquet dataset larger than Ray's object store streams through training without running out of
memory (its own Ray, with an object store of 100 MiB, so this module does not share the others')."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayjobs import train
from rayjobs.config import load_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STORE = 100 * 2**20
FEATURES, ROWS_PER_FILE, FILES = 512, 10_000, 16  # 16 x 20 MiB of float32 features


@pytest.fixture(scope="module")
def small_store_ray():
    import os

    import ray
    from conftest import REPO

    from rayjobs.launch import start_local_ray

    if ray.is_initialized():
        ray.shutdown()
    start_local_ray(
        num_cpus=2,
        env_vars={"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
        object_store_memory=STORE,
    )
    yield ray
    ray.shutdown()


def _write(folder, files: int, seed: int) -> int:
    folder.mkdir()
    rng = np.random.default_rng(seed)
    size = 0
    for i in range(files):
        y = rng.integers(0, 2, ROWS_PER_FILE)
        x = rng.normal(size=(ROWS_PER_FILE, FEATURES)).astype(np.float32)
        x[:, 0] += 2.0 * y  # one informative feature: the loss can go down
        column = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES)
        pq.write_table(pa.table({"features": column, "target": y}), folder / f"part-{i:03d}.parquet")
        size += x.nbytes
    return size


def test_a_dataset_larger_than_the_object_store_streams_through(small_store_ray, tmp_path):
    size = _write(tmp_path / "train", FILES, seed=0)
    _write(tmp_path / "val", 1, seed=1)
    store = small_store_ray.cluster_resources()["object_store_memory"]
    assert size > 3 * store, (size, store)
    cfg = load_config(
        None,
        [
            f"run.storage_path={tmp_path}",
            "run.name=big",
            "model.name=mlp",
            "model.flavor=debug",
            "data.name=parquet",
            f"data.kwargs={{path: {tmp_path / 'train'}, val_path: {tmp_path / 'val'}, features: [features], "
            "label: target, num_classes: 2}",
            "training.epochs=1",
            "training.batch_size=1000",
            "training.eval_every=0",
            "scaling.num_workers=1",
            "tracking.enabled=false",
        ],
    )
    summary = train.run(cfg)
    m = summary["metrics"]
    assert m["step"] == FILES * ROWS_PER_FILE // 1000  # every row of every file went through
    assert m["val/accuracy"] > 0.75, m
