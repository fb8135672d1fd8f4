"""GPU figures (run where CUDA is present): bf16 MFU of gpt under FSDP2 against the GPU's dense peak,
tokens/s, peak memory against rayjobs' estimate, and nn.DataParallel against DDP.

With ``RAYJOBS_GPU_CHECK=cpu`` the same code runs on the CPU (gloo, fp32, gpt debug, MFU against the
measured matmul peak): the rehearsal that ``benchmarks/gpu_check.sh --cpu`` runs in the test suite, so
the GPU script cannot break unseen between the rare sessions that have a GPU.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.base import Benchmark, Figure, Size, register, rehearsing_gpu_on_cpu
from rayjobs.telemetry import measured_matmul_peak, peak_flops


@dataclass
class Measured:
    """One strategy's steady step on this device."""

    step_s: float
    peak_gib: float | None  # peak allocated (CUDA only: the CPU allocator keeps no such count)
    estimate_gib: float
    flops_per_sample: float


def _config(strategy: str, flavor: str, seq: int, batch: int, cuda: bool):
    from rayjobs.config import from_dict

    return from_dict(
        {
            "model": {"name": "gpt", "flavor": flavor},
            "data": {"name": "synthetic", "kwargs": {"kind": "tokens", "seq_len": seq, "vocab_size": 32_000}},
            "optim": {"name": "adamw", "lr": 1e-4},
            "training": {"precision": "bf16" if cuda else "fp32", "batch_size": batch},
            "parallel": {"strategy": strategy},
        }
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(strategy: str, flavor: str, batch: int, seq: int, steps: int, device: torch.device) -> Measured:
    """Median step time of gpt ``flavor`` under ``strategy`` on one rank of the process group, after 2 warm-up steps."""
    from models import build_model, flops_per_sample
    from rayjobs import parallel, stepping, tasks
    from rayjobs.context import WorkerContext
    from rayjobs.data import data_info
    from rayjobs.memory import estimate

    cuda = device.type == "cuda"
    cfg = _config(strategy, flavor, seq, batch, cuda)
    info = data_info(cfg.data.name, cfg.data.kwargs)
    ctx, layout = parallel.place(cfg, WorkerContext(0, 1, 0, device))
    torch.manual_seed(0)
    model = build_model("gpt", flavor, {}, info).to(device)
    flops = flops_per_sample("gpt", model, info)
    par = parallel.apply(model, cfg, ctx, layout, tasks.LanguageModel().loss)
    opt = stepping.build_optimizer(par.model, cfg)
    x = torch.randint(0, info.num_classes, (batch, seq), device=device)
    y = torch.roll(x, -1, 1)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 2):
        _sync(device)
        t0 = time.perf_counter()
        stepping.train_step(par.model, [(x, y)], opt, cfg, ctx)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    est = estimate(cfg, layout, use_gpu=cuda).total / 2**30
    del par, model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return Measured(statistics.median(times), peak, est, flops)


def run(size: Size) -> list[Figure]:
    """One process, one rank (NCCL on the GPU, gloo in the rehearsal): gpt under FSDP2 with bf16
    parameters and fp32 gradient reduction, bf16 autocast, AdamW; then the same model under DDP and
    under nn.DataParallel (over every GPU this process sees)."""
    cuda = torch.cuda.is_available() and not rehearsing_gpu_on_cpu()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        flavor, batch, seq, steps = size.pick(("1b", 8, 2048, 10), ("medium", 8, 1024, 10), ("small", 8, 256, 4))
    else:
        flavor, batch, seq, steps = "debug", 4, 64, 3
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        fsdp = measure("fsdp", flavor, batch, seq, steps, device)
        ddp = measure("ddp", flavor, batch, seq, steps, device)
        dataparallel = measure("dataparallel", flavor, batch, seq, steps, device)
    finally:
        dist.destroy_process_group()
    return _figures(flavor, batch, seq, device, fsdp, ddp, dataparallel)


def _figures(
    flavor: str, batch: int, seq: int, device: torch.device, fsdp: Measured, ddp: Measured, dataparallel: Measured
) -> list[Figure]:
    cuda = device.type == "cuda"
    if cuda:
        name = torch.cuda.get_device_name(0)
        peak, against = peak_flops(name, "bf16"), f"{name} dense bf16 peak"
    else:
        peak, against = measured_matmul_peak(device), "this CPU's measured fp32 matmul peak (rehearsal)"
    achieved = fsdp.flops_per_sample * batch / fsdp.step_s
    gpus = torch.cuda.device_count() if cuda else 0
    figures = [
        Figure(
            f"gpu.mfu_{'bf16' if cuda else 'fp32'}_gpt_{flavor}",
            achieved / peak if peak else float("nan"),
            ">= 0.3",
            note=f"FSDP2 {'bf16' if cuda else 'fp32'}: {achieved / 1e12:.3g} TFLOP/s vs {against} "
            f"{(peak or 0) / 1e12:.3g} TFLOP/s",
        ),
        Figure(f"gpu.tokens_per_s_gpt_{flavor}", batch * seq / fsdp.step_s, unit="tokens/s", ratio=False),
        Figure(
            f"gpu.dataparallel_vs_ddp_step_ratio_gpt_{flavor}",
            dataparallel.step_s / ddp.step_s,
            note=f"step {dataparallel.step_s * 1e3:.1f} ms (nn.DataParallel over {max(gpus, 1)} device(s), one "
            f"process) vs {ddp.step_s * 1e3:.1f} ms (DDP, one rank on one device), the same batch of {batch}",
        ),
    ]
    if fsdp.peak_gib is not None:
        figures += [
            Figure(f"gpu.peak_memory_gib_gpt_{flavor}", fsdp.peak_gib, unit="GiB", ratio=False),
            Figure(
                f"gpu.memory_estimate_ratio_gpt_{flavor}",
                fsdp.estimate_gib / fsdp.peak_gib,
                note=f"estimate {fsdp.estimate_gib:.1f} GiB vs measured peak allocated {fsdp.peak_gib:.1f} GiB (FSDP2)",
            ),
        ]
    return figures


register(
    Benchmark(
        name="gpu",
        workload="gpt medium (quick) or 1b, 8 x seq 1024/2048, FSDP2 bf16 params + autocast, AdamW, one GPU; "
        "then DDP and nn.DataParallel",
        compares="model FLOPs/s against the GPU's dense bf16 peak; measured peak memory against the estimate; "
        "DataParallel against DDP",
        run=run,
        needs="cuda",
    )
)
