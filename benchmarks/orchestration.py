"""Orchestration overhead: the identical DDP loop's steps under torchrun and under rayjobs (Ray Train), 2 workers."""

from __future__ import annotations

import statistics

from benchmarks import launch
from benchmarks.base import Benchmark, Figure, Size, register, rounds_note


def run(size: Size) -> list[Figure]:
    """Alternate torchrun and Ray launches; compare median step times (launch times: benchmarks.startup)."""
    spec = size.pick({"steps": 40, "warmup": 3}, {"steps": 15, "warmup": 3}, launch.SMOKE_SPEC)
    rounds = size.pick(3, 3, 1)
    torch_runs, ray_runs = [], []
    for _ in range(rounds):
        torch_runs.append(launch.torchrun(spec, nproc=2))
        ray_runs.append(launch.ray_train(spec, workers=2))
    t_step = statistics.median(s for r in torch_runs for s in r["step_times"])
    r_step = statistics.median(s for r in ray_runs for s in r["step_times"])
    return [
        Figure(
            "orchestration.step_time_ratio",
            r_step / t_step,
            "<= 1.02",
            note=f"median step {r_step * 1e3:.1f} ms (Ray) vs {t_step * 1e3:.1f} ms (torchrun)"
            + rounds_note(
                [
                    statistics.median(r["step_times"]) / statistics.median(t["step_times"])
                    for r, t in zip(ray_runs, torch_runs)
                ]
            ),
        ),
    ]


register(
    Benchmark(
        name="orchestration",
        workload="gpt (dim 128, 4 layers, seq 64), 8 sequences per rank, AdamW, 2 CPU workers x 1 thread, gloo DDP",
        compares="rayjobs' launcher (local Ray + TorchTrainer) against torchrun --nproc-per-node 2, same loop",
        run=run,
    )
)
