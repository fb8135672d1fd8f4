"""Framework overhead: rayjobs' loop (local mode) against a plain PyTorch loop, same model, batch, optimizer."""

from __future__ import annotations

import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks.base import Benchmark, Figure, Size, register, rounds_note

SEQ, VOCAB, BATCH = 64, 256, 16
MODEL_KWARGS = {"dim": 128, "n_layers": 4, "n_heads": 4}


def _plain_loop(steps: int) -> float:
    """The loop from a PyTorch tutorial over the same data, timed the way rayjobs times its steps."""
    from models import DataInfo, build_model
    from rayjobs.data import synthetic

    splits = synthetic(kind="tokens", num_samples=steps * BATCH, seq_len=SEQ, vocab_size=VOCAB)
    torch.manual_seed(0)
    model = build_model("gpt", "debug", MODEL_KWARGS, DataInfo("tokens", (SEQ,), VOCAB))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(splits.train, batch_size=BATCH, shuffle=True, drop_last=True)
    elapsed, samples = 0.0, 0
    batches = iter(loader)
    for _ in range(steps):
        t0 = time.perf_counter()
        x, y = next(batches)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        elapsed += time.perf_counter() - t0
        samples += BATCH
    return samples / elapsed


def _rayjobs_loop(steps: int) -> float:
    from rayjobs import train
    from rayjobs.config import from_dict

    with tempfile.TemporaryDirectory() as d:
        cfg = from_dict(
            {
                "run": {"name": "bench-overhead", "storage_path": d},
                "model": {"name": "gpt", "flavor": "debug", "kwargs": MODEL_KWARGS},
                "data": {
                    "name": "synthetic",
                    "kwargs": {"kind": "tokens", "num_samples": steps * BATCH, "seq_len": SEQ, "vocab_size": VOCAB},
                },
                "optim": {"name": "adamw", "lr": 1e-3},
                "training": {"epochs": 1, "batch_size": BATCH, "log_every": 10_000},
                "scaling": {"num_workers": 0, "resources_per_worker": {"CPU": torch.get_num_threads()}},
            }
        )
        return train.run(cfg)["samples_per_s"]


def run(size: Size) -> list[Figure]:
    """Alternate the two loops and keep each one's best (the least disturbed) throughput."""
    steps, rounds = size.pick((100, 3), (40, 3), (10, 1))
    plain, ours = [], []
    for _ in range(rounds):
        plain.append(_plain_loop(steps))
        ours.append(_rayjobs_loop(steps))
    ratio = max(ours) / max(plain)
    return [
        Figure(
            "overhead.loop_throughput_ratio",
            ratio,
            ">= 0.99",
            note=f"{max(ours):.0f} samples/s (rayjobs, local mode) vs {max(plain):.0f} (plain loop), best of "
            f"{rounds} each" + rounds_note([o / p for o, p in zip(ours, plain)]),
        ),
    ]


register(
    Benchmark(
        name="overhead",
        workload=f"gpt (dim 128, 4 layers, seq {SEQ}), batch {BATCH}, AdamW, one process, all threads",
        compares="rayjobs' loop in Ray Train local mode against a plain PyTorch loop",
        run=run,
    )
)
