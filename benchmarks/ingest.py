"""Data ingest: the default job's share of step time waiting for data and its wall time from Parquet
against in memory, and Ray Data's throughput against a torch DataLoader over the same Parquet files."""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.base import Benchmark, Figure, Size, register, run_calls, subprocess_env

FEATURES, BATCH = 256, 256


def timed_train(storage: Path, epochs: int | None, sets: tuple[str, ...] | list[str] = ()) -> tuple[float, dict]:
    """(wall seconds, summary) of ``rayjobs train`` run in ``storage`` as a user runs it: the default job
    (2 workers, MLflow in ./results), for ``epochs`` epochs when given."""
    storage.mkdir(parents=True)
    summary = storage / "summary.json"
    sets = [*([f"training.epochs={epochs}"] if epochs else []), *sets]
    cmd = [sys.executable, "-m", "rayjobs", "train", "--summary", str(summary)]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd + [a for s in sets for a in ("--set", s)],
        cwd=storage,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"rayjobs train failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return wall, json.loads(summary.read_text())


def parquet_and_memory(epochs: int | None, rounds: int, size: Size) -> dict[str, list[float]]:
    """The default job in memory and on its Parquet form (``rayjobs data prepare digits``), alternated;
    a smoke runs both at once and in local mode (the same code path without starting Ray for the workers).

    Returns each run's wall seconds per form and the in-memory runs' data-wait fractions.
    """
    mode = ["scaling.num_workers=0"] if size.name == "smoke" else []
    out: dict[str, list[float]] = {"memory": [], "parquet": [], "wait": []}
    with tempfile.TemporaryDirectory(prefix="rj-bench-parquet-") as d:
        shards = Path(d) / "digits"
        prep = [sys.executable, "-m", "rayjobs", "data", "prepare", "digits", "--out", str(shards)]
        subprocess.run(prep, cwd=d, env=subprocess_env(), check=True, capture_output=True, timeout=600)
        parquet = [*mode, "data.name=parquet", f"data.kwargs.path={shards}"]
        for i in range(rounds):
            (wall, summary), (parquet_wall, _) = run_calls(
                [
                    functools.partial(timed_train, Path(d) / f"memory-{i}", epochs, mode),
                    functools.partial(timed_train, Path(d) / f"parquet-{i}", epochs, parquet),
                ],
                size,
            )
            out["memory"].append(wall)
            out["wait"].append(summary["metrics"]["perf/data_wait_fraction"])
            out["parquet"].append(parquet_wall)
    return out


def write_parquet(folder: Path, files: int, rows: int) -> list[str]:
    """``files`` Parquet files of ``rows`` rows: a 256-float feature column and an integer label."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(files):
        x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
        table = pa.table(
            {
                "features": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES),
                "label": rng.integers(0, 10, rows),
            }
        )
        paths.append(str(folder / f"part-{i:03d}.parquet"))
        pq.write_table(table, paths[-1])
    return paths


class ParquetBatches(torch.utils.data.IterableDataset):
    """The plain-PyTorch way: read each Parquet file with pyarrow and cut it into tensor batches."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __iter__(self):
        import pyarrow.parquet as pq

        for path in self.paths:
            table = pq.read_table(path)
            x = table["features"].combine_chunks().flatten().to_numpy().reshape(-1, FEATURES)
            y = table["label"].to_numpy()
            for i in range(0, len(y) - BATCH + 1, BATCH):
                yield torch.from_numpy(x[i : i + BATCH]), torch.from_numpy(y[i : i + BATCH])


def _second_pass_rows_per_s(batches) -> float:
    """Rows/s of the second pass over ``batches()`` (the first warms up workers and caches)."""
    for _ in batches():
        pass
    t0, rows = time.perf_counter(), 0
    for x in batches():
        rows += len(x)
    return rows / (time.perf_counter() - t0)


def rows_per_s_dataloader(paths: list[str]) -> float:
    """Rows/s of a DataLoader (one loader worker) over the files, second epoch."""
    loader = torch.utils.data.DataLoader(ParquetBatches(paths), batch_size=None, num_workers=1)
    return _second_pass_rows_per_s(lambda: (x for x, _ in loader))


def rows_per_s_ray_data(folder: Path) -> float:
    """Rows/s of rayjobs' Ray Data pipeline (read_parquet -> map_batches -> iter_torch_batches), second epoch."""
    import ray

    from rayjobs import ray_data
    from rayjobs.launch import start_local_ray

    kwargs = {
        "path": str(folder),
        "val_path": str(folder),
        "label": "label",
        "num_classes": 10,
        "features": ["features"],
    }
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ds = ray_data.datasets(ray_data.parquet(**kwargs), kwargs)["train"]
        return _second_pass_rows_per_s(
            lambda: (b["x"] for b in ds.iter_torch_batches(batch_size=BATCH, drop_last=True))
        )
    finally:
        ray.shutdown()


def loader_and_ray_data_rows_per_s(files: int, rows: int) -> tuple[float, float]:
    """Rows/s of a DataLoader and of Ray Data over the same ``files`` Parquet files of ``rows`` rows."""
    with tempfile.TemporaryDirectory(prefix="rj-bench-ingest-") as d:
        paths = write_parquet(Path(d), files, rows)
        return rows_per_s_dataloader(paths), rows_per_s_ray_data(Path(d))


def run(size: Size) -> list[Figure]:
    """The default job in memory and from Parquet; then the same Parquet files through Ray Data and a DataLoader."""
    files, rows = size.pick((16, 10_000), (4, 5_000), (2, 1_000))
    walls, (loader, ray_rows) = run_calls(
        [
            functools.partial(
                parquet_and_memory, epochs=size.pick(None, None, 1), rounds=size.pick(3, 1, 1), size=size
            ),
            functools.partial(loader_and_ray_data_rows_per_s, files, rows),
        ],
        size,
    )
    memory, parquet = statistics.median(walls["memory"]), statistics.median(walls["parquet"])
    wait = statistics.median(walls["wait"])
    mb = files * rows * FEATURES * 4 / 2**20
    return [
        Figure(
            "data.wait_fraction_default",
            wait,
            "<= 0.05",
            note="share of step time waiting for the next batch: the default job (digits, 2 workers, in-memory DataLoader)",
        ),
        Figure(
            "data.parquet_vs_memory_wall_ratio",
            parquet / memory,
            "<= 2",
            note=f"the default job, `rayjobs train` wall time: Parquet shards {parquet:.1f} s vs in memory {memory:.1f} s"
            + _spread(walls["parquet"], walls["memory"]),
        ),
        Figure(
            "data.ray_data_vs_dataloader_rows_per_s",
            ray_rows / loader,
            ">= 0.5",
            note=f"{ray_rows:,.0f} rows/s (Ray Data, 2 CPUs) vs {loader:,.0f} (DataLoader + pyarrow, 1 loader worker), "
            f"{files} Parquet files, {mb:.0f} MiB of float32 features, batches of {BATCH}; second pass of each",
        ),
    ]


def _spread(parquet: list[float], memory: list[float]) -> str:
    """ ", medians of N runs (min-max ...)" for more than one run of each, else ", one run each"."""
    if len(parquet) == 1:
        return ", one run each"
    return (
        f", medians of {len(parquet)} runs ({min(parquet):.1f}-{max(parquet):.1f} s and "
        f"{min(memory):.1f}-{max(memory):.1f} s)"
    )


register(
    Benchmark(
        name="data",
        workload="the default job (digits, 2 workers) in memory and as Parquet shards; 4 (quick) or 16 Parquet files of 256 float features",
        compares="time waiting for data against step time; Parquet wall time against in memory; Ray Data rows/s against a torch DataLoader's",
        run=run,
    )
)
