"""Datasets and per-rank shards: sizes, disjointness, determinism."""

from __future__ import annotations

import torch

from rayjobs import data


def test_digits_splits_are_disjoint_and_fixed_by_seed():
    a, b = data.digits(), data.digits()
    sizes = [len(a.train), len(a.val), len(a.test)]
    assert sum(sizes) == 1797 and sizes[1] == sizes[2] == round(1797 * 0.15)
    assert torch.equal(a.train.tensors[0], b.train.tensors[0])
    rows = {tuple(x.flatten().tolist()) + (int(y),) for part in (a.val, a.test) for x, y in part}
    assert len(rows) > 500  # mostly unique images
    other = data.digits(split_seed=1)
    assert not torch.equal(a.train.tensors[1], other.train.tensors[1])
    assert a.train.tensors[0].max() <= 1.0 and a.info.input_shape == (1, 8, 8)


def _epoch_indices(rank: int, world: int, epoch: int, seed: int = 0) -> list[int]:
    ds = torch.utils.data.TensorDataset(torch.arange(100))
    loader = data.shard_loader(ds, batch_size=10, rank=rank, world_size=world, seed=seed)
    loader.sampler.set_epoch(epoch)
    return [int(i) for (batch,) in loader for i in batch]


def test_rank_shards_are_disjoint_deterministic_and_reshuffled_each_epoch():
    r0, r1 = _epoch_indices(0, 2, 0), _epoch_indices(1, 2, 0)
    assert not set(r0) & set(r1) and len(r0) == len(r1) == 50
    assert r0 == _epoch_indices(0, 2, 0)
    assert r0 != _epoch_indices(0, 2, 1)
    assert r0 != _epoch_indices(0, 2, 0, seed=1)


def test_eval_shards_cover_every_sample_once():
    ds = torch.utils.data.TensorDataset(torch.arange(101))
    seen = [int(i) for rank in range(3) for (batch,) in data.eval_shard(ds, rank, 3, 16) for i in batch]
    assert sorted(seen) == list(range(101))


def test_synthetic_tokens_follow_their_pattern():
    s = data.synthetic(kind="tokens", num_samples=64, seq_len=12, vocab_size=50)
    x, y = s.train.tensors
    assert x.shape == (64, 12) and torch.equal(x[:, 1:], y[:, :-1])
    stride = (x[:, 1] - x[:, 0]) % 50
    assert torch.equal((x[:, 0:1] + stride[:, None] * torch.arange(12)) % 50, x)
    img = data.synthetic(kind="image", num_samples=32, shape=[3, 4, 4], num_classes=5)
    assert img.train.tensors[0].shape == (32, 3, 4, 4) and img.info.num_classes == 5


def test_digits_are_scikit_learns_read_without_importing_it():
    """The default job's data phase: the bundled CSV, not a second of `import sklearn` per worker."""
    import subprocess
    import sys

    import numpy as np
    from conftest import REPO, subprocess_env
    from sklearn.datasets import load_digits

    from rayjobs.data import load_digits_arrays

    images, target = load_digits_arrays()
    expected = load_digits()
    assert np.array_equal(images, expected.images) and np.array_equal(target, expected.target)
    assert images.dtype == expected.images.dtype and target.dtype == expected.target.dtype
    probe = "import sys; from rayjobs.data import digits; digits(); print('sklearn' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr
