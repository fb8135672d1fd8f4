"""Compute efficiency on CPU: model FLOPs/s of a gpt training step against torch.matmul's FLOP/s."""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.base import Benchmark, Figure, Size, register


def matmul_flops(n: int, repeats: int) -> float:
    """FLOP/s of an n x n fp32 matmul in this process (best of ``repeats``): the peak rayjobs' MFU uses on CPU."""
    from rayjobs.telemetry import measured_matmul_peak

    return measured_matmul_peak(torch.device("cpu"), torch.float32, n, repeats)


def model_flops(flavor: str, batch: int, seq: int, steps: int) -> tuple[float, float]:
    """(model FLOPs/s, median step seconds) of rayjobs' train_step on gpt ``flavor``."""
    from models import DataInfo, build_model, flops_per_sample
    from rayjobs.config import from_dict
    from rayjobs.context import WorkerContext
    from rayjobs.stepping import build_optimizer, train_step

    info = DataInfo("tokens", (seq,), 256)
    torch.manual_seed(0)
    model = build_model("gpt", flavor, {}, info)
    cfg = from_dict({"optim": {"name": "adamw", "lr": 1e-4}})
    opt = build_optimizer(model, cfg)
    ctx = WorkerContext(0, 1, 0, torch.device("cpu"))
    x = torch.randint(0, 256, (batch, seq))
    y = torch.roll(x, -1, 1)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        train_step(model, [(x, y)], opt, cfg, ctx)
        if i:  # the first step allocates optimizer state
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    return flops_per_sample("gpt", model, info) * batch / step, step


def run(size: Size) -> list[Figure]:
    """MFU on CPU: the peak is a matmul measured in the same process and thread setup."""
    runs = size.pick([("small", 4, 128, 3), ("medium", 4, 256, 4)], [("small", 4, 128, 3)], [("small", 2, 64, 2)])
    n = size.pick(2048, 1024, 512)
    figures, peaks = [], []
    for flavor, batch, seq, steps in runs:
        peak = matmul_flops(n, 10)
        achieved, step = model_flops(flavor, batch, seq, steps)
        peak = max(peak, matmul_flops(n, 10))  # bracket the model: the machine may have changed speed
        peaks.append(peak)
        figures.append(
            Figure(
                f"compute.mfu_cpu_gpt_{flavor}",
                achieved / peak,
                ">= 0.5",
                note=f"{achieved / 1e9:.1f} GFLOP/s in a {step:.2f} s step vs matmul peak {peak / 1e9:.1f} GFLOP/s "
                f"({torch.get_num_threads()} threads)",
            )
        )
    figures.append(
        Figure("compute.matmul_peak_gflops", max(peaks) / 1e9, unit="GFLOP/s", ratio=False, note=f"fp32 {n}x{n}")
    )
    return figures


register(
    Benchmark(
        name="compute",
        workload="gpt small (and medium unless quick), 4 sequences, one process, all threads, fp32",
        compares="model FLOPs/s of a training step (spec formula) against torch.matmul FLOP/s in the same process",
        run=run,
    )
)
