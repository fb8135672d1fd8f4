"""The helper every gloo test runs its ranks with: a machine fault is retried once, a code fault never."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from conftest import spawn_ranks


def _count_attempt(root: str, rank: int) -> int:
    """How many times this rank has started, this one included."""
    marker = Path(root) / f"rank_{rank}.attempts"
    n = int(marker.read_text()) + 1 if marker.exists() else 1
    # Written whole or not at all: the other rank's failure has the spawn kill this one, and a kill between
    # truncating and writing left an empty file that the second attempt could not read (CI, under load).
    staged = marker.with_suffix(f".{os.getpid()}")
    staged.write_text(str(n))
    os.replace(staged, marker)
    return n


def _hangs_the_first_time(rank: int, world: int, port: int, root: str) -> None:
    if _count_attempt(root, rank) == 1 and rank == 1:
        time.sleep(600)


def _aborts_the_first_time(rank: int, world: int, port: int, root: str) -> None:
    if _count_attempt(root, rank) == 1 and rank == 0:
        os.kill(os.getpid(), signal.SIGABRT)


def _raises(rank: int, world: int, port: int, root: str) -> None:
    _count_attempt(root, rank)
    raise ValueError(f"rank {rank} of {world} on port {port} fails")


def test_a_hung_rank_is_run_again_once_with_its_stacks_in_the_warning(tmp_path):
    with pytest.warns(
        UserWarning,
        match=r"(?s)rank\(s\) \[1\] of _hangs_the_first_time still running after 10 s.*line \d+ in _hangs_the_first_time",
    ):
        spawn_ranks(_hangs_the_first_time, 2, (str(tmp_path),), timeout=10)
    assert (tmp_path / "rank_1.attempts").read_text() == "2"


def test_a_rank_killed_by_a_signal_is_run_again_once(tmp_path):
    with pytest.warns(UserWarning, match="rank 0 of _aborts_the_first_time died by SIGABRT"):
        spawn_ranks(_aborts_the_first_time, 2, (str(tmp_path),))
    assert (tmp_path / "rank_0.attempts").read_text() == "2"


def test_an_exception_in_a_rank_fails_at_once(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="fails"):
        spawn_ranks(_raises, 2, (str(tmp_path),))
    assert max(int(f.read_text()) for f in tmp_path.glob("*.attempts")) == 1
