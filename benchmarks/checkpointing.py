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


def _save(flavor: str, async_save: bool, saves: int) -> tuple[list[float], float, float]:
    """Blocked seconds of each of ``saves`` saves by one Saver (as a run saves), the best total
    seconds until a save was committed, and the checkpoint's MB."""
    from rayjobs.checkpoint import Saver, TrainState, name_for

    model, opt, sched, ctx = _setup(flavor)
    root = Path(tempfile.mkdtemp(prefix="rj-ckpt-bench-"))
    blocked, best_total, size = [], float("inf"), 0.0
    try:
        saver = Saver(str(root), ctx, {}, keep_last=1, async_save=async_save)
        for step in range(1, saves + 1):
            t0 = time.perf_counter()
            saver.save(step, model, opt, sched, None, TrainState())
            blocked.append(time.perf_counter() - t0)
            saver.wait()
            while not (root / name_for(step) / "manifest.json").exists():  # the async commit runs in a callback
                time.sleep(0.001)
            best_total = min(best_total, time.perf_counter() - t0)
            size = sum(f.stat().st_size for f in (root / name_for(step)).rglob("*") if f.is_file()) / 1e6
        saver.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return blocked, best_total, size


def run(size: Size) -> list[Figure]:
    """For each size: sync save time and MB/s; async blocked time as a fraction of the sync save.

    A run saves many times with one Saver, so the async figure is the best of the saves after the
    first (the first also allocates the staging copy; its time is in the note).
    """
    flavors = size.pick(["debug", "small", "medium"], ["debug", "small"], ["small"])
    saves = size.pick(4, 3, 2)
    figures = []
    for flavor in flavors:
        _, sync_total, mb = _save(flavor, async_save=False, saves=saves)
        blocked, _, _ = _save(flavor, async_save=True, saves=saves)
        steady = min(blocked[1:])
        figures.append(
            Figure(
                f"checkpoint.async_blocked_fraction_gpt_{flavor}",
                steady / sync_total,
                "" if flavor == "debug" else "<= 0.10",  # 1 MB: fixed costs (state dict, RNG file) dominate
                note=f"{steady * 1e3:.0f} ms blocked (async, best of saves 2-{saves}; the first: "
                f"{blocked[0] * 1e3:.0f} ms) vs {sync_total * 1e3:.0f} ms (sync), {mb:.1f} MB",
            )
        )
        figures.append(
            Figure(
                f"checkpoint.sync_save_mb_per_s_gpt_{flavor}",
                mb / sync_total,
                unit="MB/s",
                ratio=False,
                note=f"{mb:.1f} MB (model + AdamW state) in {sync_total:.2f} s, manifest included",
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
