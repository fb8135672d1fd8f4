"""The launch timeline: where the time to the first step goes, for torchrun and for rayjobs' launcher.

The same DDP loop (benchmarks.workload) is launched by ``torchrun`` and by a fresh local Ray with a
``TorchTrainer`` (cold), then fitted again on that Ray (warm). Each launch's marks become the phases
of ``rayjobs.timeline``, the ones ``rayjobs train`` prints for a user's own run.
"""

from __future__ import annotations

import statistics

from benchmarks import launch
from benchmarks.base import Benchmark, Figure, Size, register
from rayjobs import timeline


def _median_phases(records: list[dict]) -> dict[str, float]:
    runs = [dict(timeline.phases(r["marks"])) for r in records]
    return {phase: statistics.median(run[phase] for run in runs) for phase in runs[0]}


def _spread(totals: list[float]) -> str:
    return f"{min(totals):.1f}-{max(totals):.1f} s over {len(totals)}" if len(totals) > 1 else "1 run"


def run(size: Size) -> list[Figure]:
    """Alternate torchrun and Ray launches (each Ray process fits twice: cold, then warm); phase medians."""
    spec = size.pick({"steps": 0, "warmup": 1}, {"steps": 0, "warmup": 1}, launch.SMOKE_SPEC)
    rounds = size.pick(3, 3, 1)
    launches: dict[str, list[dict]] = {"torchrun": [], "ray_cold": [], "ray_warm": []}
    for _ in range(rounds):
        launches["torchrun"].append(launch.torchrun(spec, nproc=2))
        cold = launch.ray_train(spec, workers=2, fits=2)
        launches["ray_cold"].append(cold)
        launches["ray_warm"].append(cold["warm"])
    figures, totals = [], {}
    for name, records in launches.items():
        parts = _median_phases(records)
        runs = [timeline.first_step_after(r["marks"]) for r in records]
        totals[name] = statistics.median(runs)
        shown = ", ".join(f"{p} {s:.1f}" for p, s in parts.items() if s >= 0.05)
        figures.append(
            Figure(
                f"launch.{name}_first_step_s",
                totals[name],
                unit="s",
                ratio=False,
                note=f"{shown} (median; total {_spread(runs)})",
                parts=parts,
            )
        )
    figures += [
        Figure(
            "launch.cold_ratio",
            totals["ray_cold"] / totals["torchrun"],
            "<= 2.5",
            note=f"new local Ray + TorchTrainer {totals['ray_cold']:.1f} s vs torchrun {totals['torchrun']:.1f} s",
        ),
        Figure(
            "launch.warm_ratio",
            totals["ray_warm"] / totals["torchrun"],
            "<= 1.5",
            note=f"fit() on a running Ray {totals['ray_warm']:.1f} s vs torchrun {totals['torchrun']:.1f} s",
        ),
    ]
    return figures


register(
    Benchmark(
        name="launch",
        workload="gpt (dim 128, 4 layers, seq 64), one step, 2 CPU workers x 1 thread, gloo DDP",
        compares="launch to first step, phase by phase: torchrun --nproc-per-node 2 vs rayjobs' launcher, cold and warm",
        run=run,
    )
)
