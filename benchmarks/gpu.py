"""GPU figures (run where CUDA is present): bf16 MFU of gpt under FSDP2 against the GPU's dense peak,
tokens/s, and peak memory against rayjobs' estimate."""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.base import Benchmark, Figure, Size, register
from rayjobs.telemetry import peak_flops


def run(size: Size) -> list[Figure]:
    """One GPU, one NCCL rank, gpt (medium in quick mode, 1b otherwise) under FSDP2 with bf16
    parameters and fp32 gradient reduction, bf16 autocast, AdamW."""
    from models import build_model, flops_per_sample
    from rayjobs import parallel, stepping, tasks
    from rayjobs.config import from_dict
    from rayjobs.context import WorkerContext
    from rayjobs.data import data_info
    from rayjobs.memory import estimate

    flavor, batch, seq, steps = size.pick(("1b", 8, 2048, 10), ("medium", 8, 1024, 10), ("small", 8, 256, 4))
    cfg = from_dict(
        {
            "model": {"name": "gpt", "flavor": flavor},
            "data": {"name": "synthetic", "kwargs": {"kind": "tokens", "seq_len": seq, "vocab_size": 32_000}},
            "optim": {"name": "adamw", "lr": 1e-4},
            "training": {"precision": "bf16", "batch_size": batch},
            "parallel": {"strategy": "fsdp"},
        }
    )
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        info = data_info(cfg.data.name, cfg.data.kwargs)
        ctx, layout = parallel.place(cfg, WorkerContext(0, 1, 0, device))
        torch.manual_seed(0)
        model = build_model("gpt", flavor, {}, info).to(device)
        flops = flops_per_sample("gpt", model, info)
        par = parallel.apply(model, cfg, ctx, layout, tasks.LanguageModel().loss)
        opt = stepping.build_optimizer(par.model, cfg)
        x = torch.randint(0, info.num_classes, (batch, seq), device=device)
        y = torch.roll(x, -1, 1)
        torch.cuda.reset_peak_memory_stats()
        times = []
        for i in range(steps + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            stepping.train_step(par.model, [(x, y)], opt, cfg, ctx)
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        peak_mem = torch.cuda.max_memory_allocated() / 2**30
        est = estimate(cfg, layout, use_gpu=True).total / 2**30
    finally:
        dist.destroy_process_group()
    step = statistics.median(times)
    name = torch.cuda.get_device_name(0)
    peak = peak_flops(name, "bf16")
    achieved = flops * batch / step
    return [
        Figure(
            f"gpu.mfu_bf16_gpt_{flavor}",
            achieved / peak if peak else float("nan"),
            ">= 0.3",
            note=f"FSDP2 bf16: {achieved / 1e12:.0f} TFLOP/s vs {name} dense bf16 peak {(peak or 0) / 1e12:.0f} TFLOP/s",
        ),
        Figure(f"gpu.tokens_per_s_gpt_{flavor}", batch * seq / step, unit="tokens/s", ratio=False),
        Figure(f"gpu.peak_memory_gib_gpt_{flavor}", peak_mem, unit="GiB", ratio=False),
        Figure(
            f"gpu.memory_estimate_ratio_gpt_{flavor}",
            est / peak_mem,
            note=f"estimate {est:.1f} GiB vs measured peak allocated {peak_mem:.1f} GiB",
        ),
    ]


register(
    Benchmark(
        name="gpu",
        workload="gpt medium (quick) or 1b, 8 x seq 1024/2048, FSDP2 bf16 params + autocast, AdamW, one GPU",
        compares="model FLOPs/s against the GPU's dense bf16 peak; measured peak memory against the estimate",
        run=run,
        needs="cuda",
    )
)
