"""``rayjobs predict``: batch inference of a checkpoint over Parquet or CSV rows with Ray Data.

The rows are read by Ray Data and handed to ``map_batches`` over a pool of actors (one per GPU where
there are GPUs, else one per two CPUs); each actor rebuilds the model once with
``checkpoint.load_for_inference`` and adds the prediction to every row it is given. The output is
Parquet: the input's columns and ``prediction`` (the class for a classifier, the value for a
regression, the most likely next token for a language model), one row per input row.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from rayjobs.errors import ConfigError
from rayjobs.preflight import check_writable_dir

FORMATS = {".parquet": "parquet", ".csv": "csv"}


class Predictor:
    """A Ray Data actor: the model built once, then ``prediction`` added to each batch of rows."""

    def __init__(self, checkpoint: str, trust_model: str, features: list[str], use_gpu: bool) -> None:
        import torch

        from rayjobs import data as data_lib
        from rayjobs.checkpoint import load_for_inference

        self.model, cfg = load_for_inference(checkpoint, trust_model)
        self.device = torch.device("cuda" if use_gpu else "cpu")
        self.model.to(self.device)
        info = data_lib.data_info(cfg.data.name, cfg.data.kwargs)
        self.shape, self.features, self.targets = tuple(info.input_shape), features, info.targets
        self.tokens = info.kind == "tokens"

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        if self.tokens:
            return {**batch, "prediction": self.next_tokens(list(batch[self.features[0]]))}
        cols = [np.stack(list(batch[c])) if batch[c].dtype == object else batch[c] for c in self.features]
        x = cols[0] if len(cols) == 1 else np.stack(cols, axis=1)
        x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32).reshape(len(x), *self.shape))
        with torch.no_grad():
            out = self.model(x.to(self.device)).float().cpu()
        if self.targets == "real":
            prediction = out.reshape(len(x), -1).squeeze(1).numpy()
        else:
            prediction = out.argmax(-1).numpy()
        return {**batch, "prediction": prediction}

    def next_tokens(self, rows: list[Any]) -> np.ndarray:
        """The most likely token after each row of token ids, from its last ``seq_len`` tokens (rows of
        one length go through the model together)."""
        import torch

        context = self.shape[0]
        out = np.zeros(len(rows), dtype=np.int64)
        by_length: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_length.setdefault(min(len(row), context), []).append(i)
        for length, index in by_length.items():
            x = torch.from_numpy(np.stack([np.asarray(rows[i][-length:], dtype=np.int64) for i in index]))
            with torch.no_grad():
                out[index] = self.model(x.to(self.device))[:, -1].argmax(-1).cpu().numpy()
        return out


def predict(
    checkpoint: str,
    data: str,
    out: str,
    features: list[str] | None = None,
    trust_model: str = "",
    batch_size: int = 256,
) -> dict[str, Any]:
    """Predict every row of the Parquet/CSV file or folder ``data`` and write them under ``out``;
    returns {rows, out, features, actors}. One-line ConfigErrors for input that does not fit."""
    from rayjobs import data as data_lib
    from rayjobs.checkpoint import CheckpointError, load_for_inference

    try:
        _, cfg = load_for_inference(checkpoint, trust_model)  # checked here, in one line, before Ray starts
    except CheckpointError as exc:
        raise ConfigError(f"predict: {exc}") from None
    info = data_lib.data_info(cfg.data.name, cfg.data.kwargs)
    files, fmt = _input_files(data)
    columns = _columns(files[0], fmt)
    features = features or _default_features(cfg, columns)
    missing = [f for f in features if f not in columns]
    if missing:
        raise ConfigError(f"predict: {files[0]} has no column(s) {', '.join(missing)}; it has {', '.join(columns)}")
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(
            f"predict: --out {out} is a file; give a new directory (predictions are written as Parquet files in it)"
        )
    if Path(out).exists() and any(Path(out).iterdir()):
        raise ConfigError(f"predict: --out {out} is not empty; give a new directory")
    (_check_tokens if info.kind == "tokens" else _check_width)(files[0], fmt, features, info)
    check_writable_dir(out, "predict: --out")
    from rayjobs.launch import connect_cluster, ray_initialized, start_local_ray

    if not ray_initialized():
        if os.environ.get("RAY_ADDRESS"):
            connect_cluster(log_to_driver=False)
        else:
            start_local_ray(num_cpus=os.cpu_count() or 1, log_to_driver=False)
    import ray

    gpus = int(ray.cluster_resources().get("GPU", 0))
    ray.data.DataContext.get_current().enable_progress_bars = False
    rows = ray.data.read_parquet(files) if fmt == "parquet" else ray.data.read_csv(files)
    # One actor per GPU; on CPUs one per two CPUs, each with one CPU, so that reading always has CPUs left.
    cpus = int(ray.cluster_resources().get("CPU", 1))
    actors = gpus or max(1, cpus // 2)
    predicted = rows.map_batches(
        Predictor,
        fn_constructor_kwargs={
            "checkpoint": str(checkpoint), "trust_model": trust_model, "features": features, "use_gpu": gpus > 0,
        },
        batch_size=batch_size,
        batch_format="numpy",
        concurrency=actors,
        num_gpus=1 if gpus else 0,
        num_cpus=1,
    )  # fmt: skip
    predicted.write_parquet(str(Path(out).resolve()))
    written = ray.data.read_parquet(str(Path(out).resolve())).count()
    return {"rows": written, "out": str(Path(out).resolve()), "features": features, "actors": actors}


def _input_files(data: str) -> tuple[list[str], str]:
    root = Path(data).expanduser().resolve()
    if root.is_file() and root.suffix in FORMATS:
        return [str(root)], FORMATS[root.suffix]
    for ext, fmt in FORMATS.items():
        found = sorted(str(p) for p in root.rglob(f"*{ext}")) if root.is_dir() else []
        if found:
            return found, fmt
    raise ConfigError(f"predict: --data {data}: no .parquet or .csv file there")


def _columns(first: str, fmt: str) -> list[str]:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(first).names)
    with open(first) as f:
        return [c.strip() for c in f.readline().split(",")]


def _default_features(cfg: Any, columns: list[str]) -> list[str]:
    """The training data's feature columns when it was a table, else every column but a label."""
    trained = cfg.data.kwargs.get("features")
    if trained:
        return list(trained)
    if "x" in columns:  # `rayjobs data prepare` writes the features as one list column x
        return ["x"]
    label = cfg.data.kwargs.get("label") or "label"
    return [c for c in columns if c not in (label, "y")]


def _first_row(table: Any, first: str) -> dict[str, Any]:
    if table.num_rows == 0:
        raise ConfigError(f"predict: {first} holds no rows (a header only?); give data with rows to predict")
    return table.slice(0, 1).to_pylist()[0]


def _check_tokens(first: str, fmt: str, features: list[str], info: Any) -> None:
    """A language model reads one column of token ids per row, each below its vocabulary size."""
    import pyarrow.parquet as pq

    if len(features) != 1 or fmt != "parquet":
        raise ConfigError(
            "predict: a language model reads one Parquet column of token ids per row (like `rayjobs data prepare "
            f"text`'s tokens); got {', '.join(features)} of {first}; name it with --features"
        )
    row = _first_row(pq.read_table(first, columns=features), first)[features[0]]
    if not isinstance(row, list) or not row or not all(isinstance(t, int) and 0 <= t < info.num_classes for t in row):
        raise ConfigError(
            f"predict: {features[0]} of {first} must hold lists of token ids in [0, {info.num_classes}) for this "
            "language model; name the right column with --features"
        )


def _check_width(first: str, fmt: str, features: list[str], info: Any) -> None:
    """The features of one row must hold as many values as the model's input."""
    import math

    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    table = pq.read_table(first, columns=features) if fmt == "parquet" else pacsv.read_csv(first)
    row = _first_row(table, first)
    width = sum(len(v) if isinstance(v, list) else 1 for k, v in row.items() if k in features)
    if width != math.prod(info.input_shape):
        raise ConfigError(
            f"predict: the model takes {math.prod(info.input_shape)} values per row (input {tuple(info.input_shape)}), "
            f"but {', '.join(features)} of {first} hold {width}; name the right columns with --features"
        )
