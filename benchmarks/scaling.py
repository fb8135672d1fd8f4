"""DDP weak scaling on this machine: 2 workers against 1, one thread each, fixed batch per worker."""

from __future__ import annotations

from benchmarks import launch
from benchmarks.base import Benchmark, Figure, Size, register


def run(size: Size) -> list[Figure]:
    """efficiency = throughput(2 workers) / (2 x throughput(1 worker))."""
    spec = size.pick({"steps": 40, "warmup": 3}, {"steps": 15, "warmup": 3}, launch.SMOKE_SPEC)
    one = launch.torchrun(spec, nproc=1)
    two = launch.torchrun(spec, nproc=2)
    efficiency = two["samples_per_s"] / (2 * one["samples_per_s"])
    return [
        Figure(
            "scaling.weak_efficiency_2w",
            efficiency,
            ">= 0.85",
            note=f"{two['samples_per_s']:.0f} samples/s on 2 workers vs {one['samples_per_s']:.0f} on 1",
        ),
    ]


register(
    Benchmark(
        name="scaling",
        workload="the orchestration workload, 8 sequences per worker, 1 and 2 workers x 1 thread",
        compares="DDP throughput of 2 workers against twice that of 1",
        run=run,
    )
)
