"""Tracking overhead: step time with MLflow logging every step against no tracking at all."""

from __future__ import annotations

import tempfile

import torch

from benchmarks.base import Benchmark, Figure, Size, register, rounds_note

SEQ, VOCAB, BATCH = 64, 256, 16


def _samples_per_s(steps: int, tracking: bool) -> float:
    from rayjobs import train
    from rayjobs.config import from_dict

    with tempfile.TemporaryDirectory() as d:
        cfg = from_dict(
            {
                "run": {"name": "bench-tracking", "storage_path": d},
                "model": {"name": "gpt", "flavor": "debug", "kwargs": {"dim": 128, "n_layers": 4, "n_heads": 4}},
                "data": {
                    "name": "synthetic",
                    "kwargs": {"kind": "tokens", "num_samples": steps * BATCH, "seq_len": SEQ, "vocab_size": VOCAB},
                },
                "training": {"epochs": 1, "batch_size": BATCH, "log_every": 10_000},
                "checkpoint": {"every_epochs": 0},
                "scaling": {"num_workers": 0, "resources_per_worker": {"CPU": torch.get_num_threads()}},
                "tracking": {"enabled": tracking, "log_every": 1, "log_checkpoints": "none"},
            }
        )
        return train.run(cfg)["samples_per_s"]


def run(size: Size) -> list[Figure]:
    """Alternate runs with and without per-step logging; compare the best step time of each."""
    steps, rounds = size.pick((150, 3), (60, 3), (15, 1))
    off, on = [], []
    for _ in range(rounds):
        off.append(_samples_per_s(steps, tracking=False))
        on.append(_samples_per_s(steps, tracking=True))
    ratio = max(off) / max(on)  # step time with logging / without
    return [
        Figure(
            "tracking.step_time_ratio_logging_every_step",
            ratio,
            "<= 1.01",
            note=f"{max(on):.0f} samples/s logging every step to MLflow (sqlite) vs {max(off):.0f} without tracking, "
            f"best of {rounds} each" + rounds_note([f / n for f, n in zip(off, on)]),
        ),
    ]


register(
    Benchmark(
        name="tracking",
        workload=f"gpt (dim 128, 4 layers, seq {SEQ}), batch {BATCH}, local mode, MLflow sqlite store",
        compares="step time with MLflow metrics logged every step against no tracking",
        run=run,
    )
)
