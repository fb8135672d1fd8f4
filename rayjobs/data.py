"""Datasets and per-rank batches.

``digits``: scikit-learn's bundled handwritten digits (1,797 real 8x8 images, 10 classes),
split into train/val/test by a fixed seed. ``synthetic``: random images, or token sequences
with a learnable pattern, of a configured shape and count, for benchmarks.

Each rank reads its shard through a ``DistributedSampler`` (``set_epoch`` every epoch), so the
order is a pure function of (seed, epoch, rank, world size).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from models.registry import DataInfo
from rayjobs.plan import StreamPlan


@dataclass
class Splits:
    """The train, validation and test datasets of a run, and what the model needs to know."""

    train: Dataset
    val: Dataset
    test: Dataset
    info: DataInfo


def _split(n: int, val_fraction: float, test_fraction: float, seed: int) -> tuple[Any, Any, Any]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test, n_val = round(n * test_fraction), round(n * val_fraction)
    return perm[n_test + n_val :], perm[n_test : n_test + n_val], perm[:n_test]


def load_digits_arrays() -> tuple[Any, Any]:
    """The digits' 8x8 images (values 0-16) and labels, exactly ``sklearn.datasets.load_digits()``'s.

    Read from the CSV scikit-learn ships, found without importing scikit-learn: importing it costs
    each worker about a second of its launch (``rayjobs bench launch``'s ``data`` phase).
    """
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # a top-level package: found, not imported
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
    from sklearn.datasets import load_digits  # a layout without the CSV: the same arrays, slower

    bunch = load_digits()
    return bunch.images, bunch.target


def digits(val_fraction: float = 0.15, test_fraction: float = 0.15, split_seed: int = 0) -> Splits:
    """scikit-learn's digits as 1x8x8 float images in [0, 1], split by ``split_seed``."""
    images, target = load_digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(target, dtype=torch.long)
    train, val, test = _split(len(y), val_fraction, test_fraction, split_seed)
    return Splits(
        TensorDataset(x[train], y[train]),
        TensorDataset(x[val], y[val]),
        TensorDataset(x[test], y[test]),
        DataInfo(kind="image", input_shape=(1, 8, 8), num_classes=10),
    )


def diabetes(val_fraction: float = 0.15, test_fraction: float = 0.2, split_seed: int = 0) -> Splits:
    """scikit-learn's bundled diabetes regression set: 442 patients, 10 standardized features, and a
    disease-progression score a year later, standardized with the training split's mean and std
    (so mse is in units of that std; r2 is the same in either unit)."""
    from sklearn.datasets import load_diabetes

    bunch = load_diabetes()
    x = torch.tensor(bunch.data, dtype=torch.float32)
    x = x / x.std(0)  # scikit-learn scales each column to unit norm; unit variance trains better
    y = torch.tensor(bunch.target, dtype=torch.float32)
    train, val, test = _split(len(y), val_fraction, test_fraction, split_seed)
    mean, std = y[train].mean(), y[train].std()
    y = (y - mean) / std
    return Splits(
        TensorDataset(x[train], y[train]),
        TensorDataset(x[val], y[val]),
        TensorDataset(x[test], y[test]),
        DIABETES_INFO,
    )


DIABETES_INFO = DataInfo(kind="image", input_shape=(10,), num_classes=1, targets="real")


def synthetic(
    kind: str = "image",
    num_samples: int = 2048,
    shape: list[int] | None = None,
    num_classes: int = 10,
    seq_len: int = 128,
    vocab_size: int = 256,
    seed: int = 0,
) -> Splits:
    """Random labelled images, or token sequences that follow ``x[t+1] = x[t] + stride (mod vocab)``."""
    g = torch.Generator().manual_seed(seed)
    n_eval = max(1, num_samples // 10)
    total = num_samples + 2 * n_eval
    if kind == "image":
        shape = list(shape or [1, 8, 8])
        x = torch.randn(total, *shape, generator=g)
        y = torch.randint(0, num_classes, (total,), generator=g)
        info = DataInfo(kind="image", input_shape=tuple(shape), num_classes=num_classes)
    else:
        start = torch.randint(0, vocab_size, (total, 1), generator=g)
        stride = torch.randint(1, 8, (total, 1), generator=g)
        seq = (start + stride * torch.arange(seq_len + 1)) % vocab_size
        x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
        info = DataInfo(kind="tokens", input_shape=(seq_len,), num_classes=vocab_size)
    a, b = num_samples, num_samples + n_eval
    return Splits(TensorDataset(x[:a], y[:a]), TensorDataset(x[a:b], y[a:b]), TensorDataset(x[b:], y[b:]), info)


@dataclass(frozen=True)
class DataSpec:
    """A named data source: its loader, and the kind of samples it gives for given kwargs."""

    name: str
    load: Callable[..., Splits]
    kind: Callable[[dict[str, Any]], str]
    description: str
    info: Callable[[dict[str, Any]], DataInfo]
    streaming: bool = False  # read through Ray Data in the workers (rayjobs.ray_data)


DATASETS: dict[str, DataSpec] = {
    "digits": DataSpec(
        "digits",
        digits,
        lambda kw: "image",
        "scikit-learn's 1,797 8x8 digit images",
        lambda kw: DataInfo(kind="image", input_shape=(1, 8, 8), num_classes=10),
    ),
    "diabetes": DataSpec(
        "diabetes",
        diabetes,
        lambda kw: "image",
        "scikit-learn's 442-patient diabetes regression set (10 features, a real target)",
        lambda kw: DIABETES_INFO,
    ),
    "synthetic": DataSpec(
        "synthetic",
        synthetic,
        lambda kw: kw.get("kind", "image"),
        "random images or patterned tokens",
        lambda kw: synthetic(**{**kw, "num_samples": 1}).info,
    ),
}


def _streaming(name: str, description: str) -> DataSpec:
    from rayjobs import ray_data

    return DataSpec(
        name,
        ray_data.LOADERS[name],
        lambda kw: ray_data.kind_of(name, kw),
        description,
        lambda kw: ray_data.info(name, kw),
        streaming=True,
    )


DATASETS.update(
    {
        "parquet": _streaming("parquet", "Parquet files through Ray Data (features + label, or tokens)"),
        "csv": _streaming("csv", "CSV files through Ray Data (numeric features + integer label)"),
        "images": _streaming("images", "an image folder per class through Ray Data"),
        "text": _streaming("text", "text files through Ray Data, byte tokens packed for gpt"),
    }
)

SYNTHETIC_KINDS = ("image", "tokens")

# The bundled loaders' numeric arguments: (lowest allowed, first not allowed); None is no limit.
BUNDLED_RANGES: dict[str, tuple[float, float | None]] = {
    "val_fraction": (0.0, 1.0),
    "test_fraction": (0.0, 1.0),
    "num_samples": (1, None),
    "num_classes": (1, None),
    "seq_len": (1, None),
    "vocab_size": (1, None),
}


def bundled_kwargs_problems(name: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A bundled in-memory dataset's kwargs, typed as its loader takes them, and (key, problem) for each
    of the wrong type or out of range (they failed inside the loader before, in every worker)."""
    from rayjobs.typed_kwargs import typed_kwargs

    clean, problems = typed_kwargs(DATASETS[name].load, kwargs, BUNDLED_RANGES)
    shape = clean.get("shape")
    if "shape" in dict(problems) or (isinstance(shape, (list, tuple)) and (not shape or min(shape) < 1)):
        problems = [p for p in problems if p[0] != "shape"]
        problems.append(("shape", f"must be a list of positive integers (one sample's shape), got {kwargs['shape']!r}"))
    return clean, problems


def spec(name: str) -> DataSpec:
    """The named dataset, or a user's ``package.module:callable`` (see ``user_splits``)."""
    if ":" not in name:
        return DATASETS[name]

    def load_user(**kwargs: Any) -> Splits:
        return _user_cache(name, kwargs)

    return DataSpec(
        name,
        load_user,
        lambda kw: load_user(**kw).info.kind,
        f"your datasets from {name}",
        lambda kw: load_user(**kw).info,
    )


_USER_SPLITS: dict[str, Splits] = {}


def _user_cache(name: str, kwargs: dict[str, Any]) -> Splits:
    import json

    key = f"{name} {json.dumps(kwargs, sort_keys=True, default=str)}"
    if key not in _USER_SPLITS:  # the driver checks kind and targets, then loads: one call of the user's code
        from models.registry import resolve_callable

        _USER_SPLITS[key] = user_splits(resolve_callable(name)(**kwargs), name)
    return _USER_SPLITS[key]


def user_splits(result: Any, name: str) -> Splits:
    """A user's datasets as Splits: a Splits, or (train, val[, test]) map-style datasets of (x, y)
    samples, or a dict with those keys. What the model needs to know is read from the samples: x's
    shape; integer y are classes (max + 1 over train; tokens when x is an integer sequence too), float
    y are real-valued targets (regression, one output per element of y)."""
    if isinstance(result, Splits):
        return result
    if isinstance(result, dict):
        result = (result.get("train"), result.get("val"), result.get("test"))
    parts = list(result) if isinstance(result, (tuple, list)) else []
    if len(parts) == 2:
        parts.append(None)
    if len(parts) != 3 or not all(isinstance(p, Dataset) for p in parts[:2]):
        raise TypeError(
            f"{name} must return (train, val[, test]) torch Datasets, a dict of them, or rayjobs.data.Splits; "
            f"got {type(result).__name__}"
        )
    train, val, test = parts
    sample = train[0]
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise TypeError(f"{name}: a sample must be (x, y) tensors, got {type(sample).__name__}")
    x, y = (torch.as_tensor(v) for v in sample)
    if y.is_floating_point():
        info = DataInfo("image", tuple(x.shape), max(1, y.numel()), targets="real")
    else:
        top = max(int(torch.as_tensor(train[i][1]).max()) for i in range(len(train)))  # type: ignore[arg-type]
        tokens = not x.is_floating_point() and x.ndim == 1 and y.shape == x.shape
        classes = max(top, int(x.max())) + 1 if tokens else top + 1
        info = DataInfo("tokens" if tokens else "image", tuple(x.shape), classes)
    return Splits(train, val, test if test is not None else val, info)


def load(name: str, kwargs: dict[str, Any]) -> Splits:
    """Load the named dataset with its kwargs."""
    return spec(name).load(**kwargs)


def example_inputs(name: str, kwargs: dict[str, Any], n: int = 4) -> tuple[DataInfo, torch.Tensor]:
    """(what the model needs to know, ``n`` model inputs) of the evaluation data, for signatures and examples.

    In-memory datasets give their first test samples; streamed ones read a few rows of the
    validation files through the same ``map_batches`` the workers use.
    """
    if is_streaming(name):
        from rayjobs import ray_data

        source = spec(name).load(**kwargs)
        return source.info, ray_data.first_inputs(source, kwargs, n)
    splits = load(name, kwargs)
    evaluation = _unless_empty(splits.test) or splits.val
    rows = range(min(n, len(evaluation)))  # type: ignore[arg-type]
    return splits.info, torch.stack([torch.as_tensor(evaluation[i][0]) for i in rows])


def _unless_empty(dataset: Any) -> Any:
    """``dataset``, or None where it holds no row (``test_fraction=0``: a run without test metrics)."""
    return None if dataset is None or len(dataset) == 0 else dataset


def train_rows(name: str, kwargs: dict[str, Any], split: str = "train") -> int:
    """Samples in the training split, or in ``split`` (streamed sources count rows from file metadata;
    ``synthetic`` from its kwargs, without making the data)."""
    if is_streaming(name):
        return spec(name).load(**kwargs).rows.get(split, 0)
    if name == "synthetic":
        n = int(kwargs.get("num_samples", inspect.signature(synthetic).parameters["num_samples"].default))
        return n if split == "train" else max(1, n // 10)
    return len(getattr(load(name, kwargs), split))  # type: ignore[arg-type]


def is_streaming(name: str) -> bool:
    """Whether the named dataset streams through Ray Data (else it is loaded whole in each worker)."""
    return spec(name).streaming


class InMemory:
    """A Ray Data shard read once, on first use, into tensors held by this worker (small splits only)."""

    def __init__(self, shard: Any) -> None:
        self.shard = shard
        self._dataset: TensorDataset | None = None

    def dataset(self) -> TensorDataset:
        """Every row of the shard as a TensorDataset of (x, y); the first call reads it through Ray Data."""
        if self._dataset is None:
            xs, ys = [], []
            for batch in self.shard.iter_torch_batches(batch_size=1024):
                xs.append(batch["x"])
                ys.append(batch["y"])
            self._dataset = TensorDataset(torch.cat(xs), torch.cat(ys))
        return self._dataset


def eval_batches(dataset: Any, rank: int, world_size: int, batch_size: int) -> Any:
    """Batches of an evaluation set for this rank: every sample once across ranks (map-style or Ray Data)."""
    if isinstance(dataset, InMemory):
        dataset = dataset.dataset()
    if isinstance(dataset, Dataset):
        return eval_shard(dataset, rank, world_size, batch_size)
    from rayjobs import ray_data

    return ray_data.eval_batches(dataset, batch_size, rank, world_size)


def data_info(name: str, kwargs: dict[str, Any]) -> DataInfo:
    """What a model needs to know about the named dataset, without loading it."""
    return spec(name).info(kwargs)


def accepted_kwargs(fn: Callable[..., Any]) -> list[str] | None:
    """Keyword names ``fn`` accepts (None when it takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way: ``start_index`` samples are skipped.

    The order is still a pure function of (seed, epoch, rank, world size), so a run resumed at
    step k of an epoch sees exactly the samples the uninterrupted run saw from step k on.
    """

    start_index: int = 0

    def __iter__(self):  # type: ignore[override]
        return iter(list(super().__iter__())[self.start_index :])

    def __len__(self) -> int:
        return max(0, super().__len__() - self.start_index)


def shard_loader(
    dataset: Dataset, batch_size: int, rank: int, world_size: int, seed: int, shuffle: bool = True
) -> DataLoader:
    """This rank's loader over ``dataset``: a resumable DistributedSampler with equal, full batches.

    Call ``loader.sampler.set_epoch(epoch)`` at the start of every epoch. The loader has its own
    generator, so creating an iterator never draws from the global RNG (which dropout uses).
    """
    sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed),
    )


def eval_shard(dataset: Dataset, rank: int, world_size: int, batch_size: int) -> DataLoader:
    """Every sample exactly once across ranks (strided, no padding), for sums that are all-reduced."""
    indices = list(range(rank, len(dataset), world_size))  # type: ignore[arg-type]
    return DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=batch_size)


class TrainingData:
    """What a worker trains and evaluates on: its micro-batches one epoch at a time, and the
    validation and test sets. In memory (a resumable sampler over a map-style dataset) or streamed
    (this worker's Ray Data shard; the driver counted the rows and passes a ``StreamPlan``)."""

    def __init__(
        self,
        name: str,
        kwargs: dict[str, Any],
        seed: int,
        shard: int,
        shards: int,
        micro_batch: int,
        accum: int,
        stream: StreamPlan | None = None,
    ) -> None:
        self.micro_batch, self.accum, self.seed = micro_batch, accum, seed
        self.streaming = stream is not None
        if stream is not None:
            import ray.train

            self.info = DataInfo(stream.kind, tuple(stream.shape), stream.classes)
            self.train = ray.train.get_dataset_shard("train")
            self.val = ray.train.get_dataset_shard("val")
            self.test = ray.train.get_dataset_shard("test") if stream.has_test else None
            if stream.in_memory:  # small enough: read once per worker, then trained on from memory
                self.val = InMemory(self.val)
                self.test = InMemory(self.test) if self.test is not None else None
                self.cached_train: InMemory | None = InMemory(self.train)
            else:
                self.cached_train = None
            # Ray Train splits train equally over the workers; full micro-batches only.
            per_worker = stream.train_rows // stream.world_size
            self.steps_per_epoch = per_worker // micro_batch // accum
        else:
            splits = load(name, kwargs)
            self.info, self.val, self.test = splits.info, splits.val, _unless_empty(splits.test)
            self.loader = shard_loader(splits.train, micro_batch, shard, shards, seed)
            self.steps_per_epoch = len(self.loader) // accum

    def epoch(self, epoch: int, step_in_epoch: int) -> Any:
        """An iterator of (x, y) micro-batches for ``epoch``, starting at ``step_in_epoch``."""
        skip = step_in_epoch * self.accum
        if self.streaming and self.cached_train is None:
            from rayjobs import ray_data

            return ray_data.train_batches(self.train, self.micro_batch, self.seed, epoch, skip)
        if self.streaming and not hasattr(self, "loader"):
            # This worker's shard, read once through Ray Data, is then shuffled per epoch like in-memory data.
            self.loader = shard_loader(self.cached_train.dataset(), self.micro_batch, 0, 1, self.seed)
        self.loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        self.loader.sampler.start_index = skip * self.micro_batch  # type: ignore[attr-defined]
        return iter(self.loader)

    def finish_epoch(self, batches: Any) -> None:
        """Read what is left of a streamed epoch, so that every worker's shard ends it together."""
        if self.streaming and self.cached_train is None:
            for _ in batches:
                pass
