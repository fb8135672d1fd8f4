"""GPU figures (run where CUDA is present): bf16 MFU against the GPU's dense peak, tokens/s, peak memory."""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.harness import Benchmark, Figure, register
from rayjobs.telemetry import peak_flops


def run(quick: bool) -> list[Figure]:
    """One GPU, gpt (medium in quick mode, 1b otherwise), bf16 autocast, AdamW."""
    from models import DataInfo, build_model, flops_per_sample
    from rayjobs.config import from_dict
    from rayjobs.loop import build_optimizer, train_step
    from rayjobs.parallel import WorkerContext

    flavor, batch, seq, steps = ("medium", 8, 1024, 10) if quick else ("1b", 8, 2048, 10)
    device = torch.device("cuda", 0)
    info = DataInfo("tokens", (seq,), 32_000)
    torch.manual_seed(0)
    model = build_model("gpt", flavor, {}, info).to(device)
    cfg = from_dict({"optim": {"name": "adamw", "lr": 1e-4}, "training": {"precision": "bf16"}})
    opt = build_optimizer(model, cfg)
    ctx = WorkerContext(0, 1, 0, device)
    x = torch.randint(0, info.num_classes, (batch, seq), device=device)
    y = torch.roll(x, -1, 1)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step(model, [(x, y)], opt, cfg, ctx)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    name = torch.cuda.get_device_name(0)
    peak = peak_flops(name, "bf16")
    achieved = flops_per_sample("gpt", model, info) * batch / step
    return [
        Figure(
            f"gpu.mfu_bf16_gpt_{flavor}",
            achieved / peak if peak else float("nan"),
            ">= 0.3",
            note=f"{achieved / 1e12:.0f} TFLOP/s vs {name} dense bf16 peak {peak / 1e12:.0f} TFLOP/s",
        ),
        Figure(f"gpu.tokens_per_s_gpt_{flavor}", batch * seq / step, unit="tokens/s", ratio=False),
        Figure(f"gpu.peak_memory_gib_gpt_{flavor}", torch.cuda.max_memory_allocated() / 2**30, unit="GiB", ratio=False),
    ]


register(
    Benchmark(
        name="gpu",
        workload="gpt medium (quick) or 1b, 8 x seq 1024/2048, bf16 autocast, AdamW, one GPU",
        compares="model FLOPs/s against the GPU's dense bf16 peak",
        run=run,
        needs="cuda",
    )
)
