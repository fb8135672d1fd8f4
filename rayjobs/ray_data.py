"""Streaming data through Ray Data: Parquet, CSV, image folders and text, for data larger than memory.

The driver resolves a source (paths, columns, what the model needs to know), checks it before any
worker starts, and builds Ray Datasets whose ``map_batches`` turns rows into ``x``/``y`` arrays;
they go to ``TorchTrainer(datasets=...)``. Each worker streams its shard of ``train`` through
``get_dataset_shard("train").iter_torch_batches(...)``; ``val`` and ``test`` are not split (each
worker reads them and evaluates every world-size-th batch), so every sample is counted once.

Resume with Ray Data is exact in the model, optimizer, step and epoch, and resumes the data from
the start of the interrupted epoch: the batches already trained in it are read again and skipped.
Ray Data hands blocks to workers dynamically, so the skipped batches are the same number, not
necessarily the same samples, as before the interruption.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.registry import DataInfo

META = "rayjobs-data.json"  # written by `rayjobs data prepare`: the defaults for its columns
SPLITS = ("train", "val", "test")
VOCAB = 256  # the byte-level tokenizer: one token per byte


class DataError(ValueError):
    """A data source that cannot be read as configured (one line: the file or column, and the fix)."""


@dataclass(frozen=True)
class Source:
    """A resolved streaming source: where each split is, which columns, and what the model needs."""

    fmt: str  # parquet | csv | images | text
    paths: dict[str, list[str]]  # split -> files
    info: DataInfo
    features: list[str] = field(default_factory=list)
    label: str = ""
    seq_len: int = 0
    classes: list[str] = field(default_factory=list)  # image folders, in label order
    rows: dict[str, int] = field(default_factory=dict)  # split -> rows (train: for the schedule)


# ---- the loaders named by data.name (their keyword arguments are data.kwargs) ------------------


def parquet(
    path: str,
    features: list[str] | None = None,
    label: str = "",
    shape: list[int] | None = None,
    num_classes: int = 0,
    val_path: str = "",
    test_path: str = "",
) -> Source:
    """Parquet files: feature columns (one list column, or scalar columns) and a label column; or a
    token column written by ``rayjobs data prepare text``. Defaults come from ``rayjobs-data.json``."""
    return resolve("parquet", locals())


def csv(
    path: str,
    features: list[str] | None = None,
    label: str = "label",
    shape: list[int] | None = None,
    num_classes: int = 0,
    val_path: str = "",
    test_path: str = "",
) -> Source:
    """CSV files with a header: numeric feature columns (default: all but the label) and an integer label."""
    return resolve("csv", locals())


def images(
    path: str, size: list[int] | None = None, mode: str = "L", val_path: str = "", test_path: str = ""
) -> Source:
    """An image folder per class (``<path>/<class>/*.png``), resized to ``size`` [h, w], mode L or RGB."""
    return resolve("images", locals())


def text(path: str, seq_len: int = 128, val_path: str = "", test_path: str = "") -> Source:
    """Text files, tokenized as bytes (vocabulary 256) and packed into sequences of ``seq_len`` + 1."""
    return resolve("text", locals())


LOADERS = {"parquet": parquet, "csv": csv, "images": images, "text": text}


def kind_of(name: str, kwargs: dict[str, Any]) -> str:
    """image or tokens, without reading data (text, and Parquet that ``prepare text`` wrote, are tokens)."""
    if name == "text":
        return "tokens"
    if name == "parquet" and kwargs.get("path"):
        meta = _meta(kwargs["path"])
        return meta.get("kind", "image")
    return "image"


# ---- resolving and checking a source on the driver ----------------------------------------------


def _meta(path: str) -> dict[str, Any]:
    p = os.path.join(os.path.abspath(os.path.expanduser(path)), META)
    if os.path.isfile(p):
        with open(p) as f:
            return json.load(f)
    return {}


def _files(path: str, fmt: str, where: str) -> list[str]:
    root = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(root):
        raise DataError(f"{where}: no such file or directory: {root}")
    if os.path.isfile(root):
        return [root]
    ext = {
        "parquet": (".parquet",),
        "csv": (".csv",),
        "text": (".txt", ".text", ".md"),
        "images": (".png", ".jpg", ".jpeg"),
    }[fmt]
    found = sorted(f for f in glob.glob(os.path.join(root, "**", "*"), recursive=True) if f.lower().endswith(ext))
    if not found:
        raise DataError(f"{where}: no {'/'.join(ext)} files under {root}")
    return found


def _split_paths(fmt: str, kw: dict[str, Any]) -> dict[str, list[str]]:
    """train/val/test files: ``path/{train,val,test}`` when they exist, else ``path`` and ``val_path``/``test_path``."""
    root = os.path.abspath(os.path.expanduser(kw["path"]))
    if fmt != "images" and os.path.isdir(os.path.join(root, "train")):
        paths = {
            s: _files(os.path.join(root, s), fmt, f"data.kwargs.path ({s}/)")
            for s in SPLITS
            if os.path.isdir(os.path.join(root, s))
        }
    else:
        paths = {"train": _files(root, fmt, "data.kwargs.path")}
    for split in ("val", "test"):
        if kw.get(f"{split}_path"):
            paths[split] = _files(kw[f"{split}_path"], fmt, f"data.kwargs.{split}_path")
    if "val" not in paths:
        how = (
            f" (or a {root}/val/ folder beside {root}/train/)"
            if os.path.isdir(root)
            else ", a file or folder of validation rows"
        )
        raise DataError(f"data.kwargs.val_path: {fmt} data at {root} has no validation split; give val_path{how}")
    return paths


def resolve(fmt: str, kw: dict[str, Any]) -> Source:
    """The source for these kwargs, with its columns checked against the files' schema."""
    paths = _split_paths(fmt, kw)
    if fmt == "text":
        seq = int(kw["seq_len"])
        if seq < 1:
            raise DataError(f"data.kwargs.seq_len: must be >= 1, got {kw['seq_len']}")
        rows = {s: sum(os.path.getsize(f) // (seq + 1) for f in files) for s, files in paths.items()}
        return Source("text", paths, DataInfo("tokens", (seq,), VOCAB), seq_len=seq, rows=rows)
    if fmt == "images":
        return _resolve_images(kw, paths)
    meta = _meta(kw["path"]) if fmt == "parquet" else {}
    columns = {s: _columns(fmt, files) for s, files in paths.items()}
    train_cols = columns["train"]
    label = kw.get("label") or meta.get("label", "")
    if meta.get("kind") == "tokens":
        column = (kw.get("features") or meta["features"])[0]
        _need([column], train_cols, paths["train"][0])
        seq = int(meta["seq_len"])
        return Source(fmt, paths, DataInfo("tokens", (seq,), VOCAB), [column], seq_len=seq, rows=_rows(fmt, paths))
    if not label:
        raise DataError(
            f"data.kwargs.label: name the label column of {paths['train'][0]} (columns: {', '.join(train_cols)})"
        )
    features = list(kw.get("features") or meta.get("features") or [c for c in train_cols if c != label])
    for split, cols in columns.items():
        _need([*features, label], cols, paths[split][0])
    shape = tuple(kw.get("shape") or meta.get("shape") or _feature_shape(fmt, paths["train"][0], features))
    classes = int(kw.get("num_classes") or meta.get("num_classes") or 0)
    if not classes:
        raise DataError(f"data.kwargs.num_classes: how many classes does column {label!r} have? (set it, e.g. 10)")
    return Source(fmt, paths, DataInfo("image", shape, classes), features, label, rows=_rows(fmt, paths))


def _columns(fmt: str, files: list[str]) -> list[str]:
    import pyarrow.parquet as pq

    first = files[0]
    try:
        if fmt == "parquet":
            return list(pq.read_schema(first).names)
        with open(first) as f:
            return [c.strip() for c in f.readline().strip().split(",")]
    except Exception as exc:  # noqa: BLE001 - an unreadable file is the user's to fix
        raise DataError(f"data.kwargs.path: cannot read {first} as {fmt}: {exc}") from None


def _need(wanted: list[str], have: list[str], file: str) -> None:
    missing = [c for c in wanted if c not in have]
    if missing:
        raise DataError(
            f"data.kwargs: column {missing[0]!r} is not in {file} (columns: {', '.join(have)}); "
            "set data.kwargs.features / data.kwargs.label to columns it has"
        )


def _feature_shape(fmt: str, first: str, features: list[str]) -> tuple[int, ...]:
    """Scalar columns: (their count,); one list column: (its length,), from the schema or the first row."""
    if fmt != "parquet" or len(features) != 1:
        return (len(features),)
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = pq.read_schema(first).field(features[0]).type
    if pa.types.is_fixed_size_list(kind):
        return (kind.list_size,)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        head = pq.ParquetFile(first).read_row_group(0, columns=features).column(0)
        return (len(head[0]),) if len(head) else (1,)
    return (1,)


def _rows(fmt: str, paths: dict[str, list[str]]) -> dict[str, int]:
    """Rows per split: Parquet from file metadata (no data read); CSV by counting lines."""
    import pyarrow.parquet as pq

    if fmt == "parquet":
        return {s: sum(pq.ParquetFile(f).metadata.num_rows for f in files) for s, files in paths.items()}
    out = {}
    for split, files in paths.items():
        out[split] = 0
        for f in files:
            with open(f, "rb") as fh:
                out[split] += max(0, sum(1 for _ in fh) - 1)
    return out


def _resolve_images(kw: dict[str, Any], paths: dict[str, list[str]]) -> Source:
    root = os.path.abspath(os.path.expanduser(kw["path"]))
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if len(classes) < 2:
        raise DataError(f"data.kwargs.path: {root} needs one folder per class (found {len(classes)})")
    h, w = kw.get("size") or [32, 32]
    channels = 1 if kw.get("mode", "L") == "L" else 3
    rows = {s: len(f) for s, f in paths.items()}
    return Source("images", paths, DataInfo("image", (channels, h, w), len(classes)), classes=classes, rows=rows)


def info(name: str, kwargs: dict[str, Any]) -> DataInfo:
    """What the model needs to know (checks the source; DataError when it cannot be read)."""
    return LOADERS[name](**kwargs).info


# ---- Ray Datasets (driver) ----------------------------------------------------------------------


def datasets(source: Source, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Ray Datasets per split, already mapped to ``x`` (features or tokens) and ``y`` (label or next tokens)."""
    import logging

    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # not a progress report per epoch and eval
    return {split: _dataset(source, files, kwargs, split) for split, files in source.paths.items()}


def read_evaluation_splits_once(datasets: dict[str, Any]) -> dict[str, Any]:
    """``datasets`` with val and test read here, once, into Ray's object store.

    Every worker reads all of val and test (they are not split); left as reads, each worker ran
    its own Ray Data execution of each, each starting its own read tasks: 4 executions of about
    10 s for 540 digits rows on 2 workers. Read once here, a worker's pass is a fetch from the store.
    """
    return {split: ds if split == "train" else ds.materialize() for split, ds in datasets.items()}


def _dataset(source: Source, files: list[str], kwargs: dict[str, Any], split: str = "train") -> Any:
    import ray.data

    if source.fmt == "parquet":
        ds = ray.data.read_parquet(files, columns=[*source.features, *([source.label] if source.label else [])])
    elif source.fmt == "csv":
        ds = ray.data.read_csv(files)
    elif source.fmt == "text":
        ds = ray.data.read_binary_files(files)
        return ds.flat_map(_pack(source.seq_len)).map_batches(_tokens_to_xy, batch_format="numpy")
    else:
        from ray.data.datasource.partitioning import Partitioning

        # Class folders under the split's own root: `path` for train, `val_path` / `test_path` for the others.
        root = os.path.abspath(os.path.expanduser(kwargs.get(f"{split}_path") or kwargs["path"]))
        h, w = source.info.input_shape[1:]
        ds = ray.data.read_images(
            files,
            size=(h, w),
            mode=kwargs.get("mode", "L"),
            partitioning=Partitioning("dir", field_names=["label"], base_dir=root),
        )
        return ds.map_batches(_images_to_xy(source.classes, source.info.input_shape), batch_format="numpy")
    if source.info.kind == "tokens":
        return ds.map_batches(_tokens_to_xy, batch_format="numpy", fn_kwargs={"column": source.features[0]})
    return ds.map_batches(_table_to_xy(source.features, source.label, source.info.input_shape), batch_format="numpy")


class _pack:
    """One text file's bytes -> rows of ``seq_len + 1`` tokens (the remainder of the file is dropped)."""

    def __init__(self, seq_len: int) -> None:
        self.n = seq_len + 1

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        tokens = np.frombuffer(row["bytes"], dtype=np.uint8)
        usable = len(tokens) // self.n * self.n
        return [{"tokens": chunk} for chunk in tokens[:usable].astype(np.int16).reshape(-1, self.n)]


def _tokens_to_xy(batch: dict[str, np.ndarray], column: str = "tokens") -> dict[str, np.ndarray]:
    tokens = np.stack(list(batch[column])).astype(np.int64)
    return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


class _table_to_xy:
    def __init__(self, features: list[str], label: str, shape: tuple[int, ...]) -> None:
        self.features, self.label, self.shape = features, label, shape

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        cols = [np.stack(list(batch[c])) if batch[c].dtype == object else batch[c] for c in self.features]
        x = cols[0] if len(cols) == 1 else np.stack(cols, axis=1)
        x = x.astype(np.float32).reshape(len(x), *self.shape)
        return {"x": x, "y": batch[self.label].astype(np.int64)}


class _images_to_xy:
    def __init__(self, classes: list[str], shape: tuple[int, ...]) -> None:
        self.index, self.shape = {c: i for i, c in enumerate(classes)}, shape

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = np.stack(list(batch["image"])).astype(np.float32) / 255.0
        x = x.reshape(len(x), *self.shape) if x.ndim == 3 else x.transpose(0, 3, 1, 2)
        return {"x": np.ascontiguousarray(x), "y": np.array([self.index[c] for c in batch["label"]], dtype=np.int64)}


IN_MEMORY_LIMIT_BYTES = 256 * 2**20  # a worker keeps a streamed split in memory below this estimate


def fits_in_memory(source: Source, world_size: int) -> bool:
    """Whether every split is small enough for each worker to hold (train: its share) after one read.

    The estimate counts x and y as 8-byte values, a ceiling for float32 features and int64 tokens.
    """
    per_row = 1
    for n in source.info.input_shape:
        per_row *= n
    row_bytes = 8 * per_row + (8 * per_row if source.info.kind == "tokens" else 8)
    train = source.rows.get("train", 0) // max(1, world_size)
    evals = sum(source.rows.get(s, 0) for s in ("val", "test"))
    return (train + evals) * row_bytes <= IN_MEMORY_LIMIT_BYTES


def first_inputs(source: Source, kwargs: dict[str, Any], n: int) -> Any:
    """The first ``n`` model inputs of the validation split, mapped as the workers map them."""
    import torch

    batch = _dataset(source, source.paths["val"], kwargs, "val").take_batch(n, batch_format="numpy")
    return torch.from_numpy(np.array(batch["x"]))  # a copy: the batch is read-only


# ---- workers ------------------------------------------------------------------------------------


def train_batches(shard: Any, micro_batch: int, seed: int, epoch: int, skip: int) -> Iterator[tuple[Any, Any]]:
    """One epoch of this worker's shard as (x, y) micro-batches: shuffled locally from the seed and
    epoch, the first ``skip`` micro-batches read and dropped (a resume inside the epoch)."""
    batches = shard.iter_torch_batches(
        batch_size=micro_batch,
        drop_last=True,
        local_shuffle_buffer_size=max(4 * micro_batch, 256),
        local_shuffle_seed=seed * 100_003 + epoch,
    )
    for i, batch in enumerate(batches):
        if i >= skip:
            yield batch["x"], batch["y"]


def eval_batches(dataset: Any, batch_size: int, rank: int, world_size: int) -> Iterator[tuple[Any, Any]]:
    """Every world-size-th batch of an unsplit dataset, starting at this rank's: each sample once overall."""
    for i, batch in enumerate(dataset.iter_torch_batches(batch_size=batch_size)):
        if i % world_size == rank:
            yield batch["x"], batch["y"]
