"""Checkpoint cost: how long a step is blocked by an async save against a synchronous save, and
save time against checkpoint size."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.base import Benchmark, Figure, Size, register


def _setup(flavor: str):
    from models import DataInfo, build_model
    from rayjobs.config import from_dict
    from rayjobs.context import WorkerContext
    from rayjobs.stepping import build_optimizer, build_scheduler, train_step

    info = DataInfo("tokens", (64,), 256)
    model = build_model("gpt", flavor, {}, info)
    cfg = from_dict({"optim": {"name": "adamw", "lr": 1e-4}})
    opt = build_optimizer(model, cfg)
    ctx = WorkerContext(0, 1, 0, torch.device("cpu"))
    x = torch.randint(0, 256, (2, 64))
    train_step(model, [(x, torch.roll(x, -1, 1))], opt, cfg, ctx)  # optimizer state exists
    return model, opt, build_scheduler(opt, cfg, 100), ctx


def _save(flavor: str, async_save: bool, rounds: int) -> tuple[float, float, float]:
    """(blocked seconds, total seconds until committed, checkpoint MB), best of ``rounds``."""
    from rayjobs.checkpoint import Saver, TrainState

    model, opt, sched, ctx = _setup(flavor)
    best_blocked, best_total, size = float("inf"), float("inf"), 0.0
    for r in range(rounds):
        root = Path(tempfile.mkdtemp(prefix="rj-ckpt-bench-"))
        try:
            saver = Saver(str(root), ctx, {}, keep_last=1, async_save=async_save)
            t0 = time.perf_counter()
            saver.save(r + 1, model, opt, sched, None, TrainState())
            blocked = time.perf_counter() - t0
            saver.wait()
            while not any(root.glob("checkpoint_*/manifest.json")):  # the async commit runs in a callback
                time.sleep(0.001)
            total = time.perf_counter() - t0
            size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 1e6
            best_blocked, best_total = min(best_blocked, blocked), min(best_total, total)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return best_blocked, best_total, size


def run(size: Size) -> list[Figure]:
    """For each size: sync save time and MB/s; async blocked time as a fraction of the sync save."""
    flavors = size.pick(["debug", "small", "medium"], ["debug", "small"], ["small"])
    rounds = size.pick(3, 2, 1)
    figures = []
    for flavor in flavors:
        _, sync_total, size = _save(flavor, async_save=False, rounds=rounds)
        blocked, _, _ = _save(flavor, async_save=True, rounds=rounds)
        figures.append(
            Figure(
                f"checkpoint.async_blocked_fraction_gpt_{flavor}",
                blocked / sync_total,
                "<= 0.5",
                note=f"{blocked * 1e3:.0f} ms blocked (async) vs {sync_total * 1e3:.0f} ms (sync), {size:.1f} MB",
            )
        )
        figures.append(
            Figure(
                f"checkpoint.sync_save_mb_per_s_gpt_{flavor}",
                size / sync_total,
                unit="MB/s",
                ratio=False,
                note=f"{size:.1f} MB (model + AdamW state) in {sync_total:.2f} s, manifest included",
            )
        )
    return figures


register(
    Benchmark(
        name="checkpoint",
        workload="gpt debug/small(/medium) + AdamW state, one process, DCP to local disk, sha256 manifest",
        compares="time the training loop is blocked by an async save against a synchronous save",
        run=run,
    )
)
