"""Memory estimates per strategy, out-of-memory reporting, and the device check across ranks."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_cli, spawn_ranks

from rayjobs import devices
from rayjobs.config import from_dict
from rayjobs.context import WorkerContext
from rayjobs.memory import estimate
from rayjobs.parallel import resolve_layout


def _estimate(strategy: str, world: int, **parallel):
    cfg = from_dict(
        {
            "model": {"name": "gpt", "flavor": "small"},
            "data": {"name": "synthetic", "kwargs": {"kind": "tokens", "seq_len": 128}},
            "training": {"batch_size": 16},
            "parallel": {"strategy": strategy, **parallel},
        }
    )
    return estimate(cfg, resolve_layout(cfg.parallel, world), use_gpu=False)


def test_fsdp_halves_the_states_and_checkpointing_cuts_activations():
    ddp, fsdp = _estimate("ddp", 2), _estimate("fsdp", 2)
    assert fsdp.states / ddp.states == pytest.approx(0.5)
    assert ddp.optimizer == 2 * ddp.parameters  # AdamW: two fp32 moments per parameter
    assert fsdp.activations == ddp.activations  # FSDP shards states, not activations
    full = _estimate("ddp", 2, activation_checkpointing="full")
    assert full.activations < 0.3 * ddp.activations
    tp = _estimate("tp", 2)
    assert tp.parameters < 0.6 * _estimate("ddp", 1).parameters  # blocks split in two, embeddings whole
    assert 0.3 < _estimate("pp", 2).parameters / _estimate("ddp", 1).parameters < 0.7


def test_unlike_devices_name_the_rank_and_the_fix():
    a100 = {"host": "n1", "name": "NVIDIA A100-SXM4-80GB", "memory_gib": 79.3, "capability": "8.0"}
    h100 = {"host": "n2", "name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.1, "capability": "9.0"}
    assert devices.differences([a100, a100]) == []
    (line,) = devices.differences([a100, h100])
    assert line.startswith("rank 1 on n2 has NVIDIA H100 80GB HBM3 (79.1 GiB, 9.0), rank 0 on n1 has NVIDIA A100")


def _gather_worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    found = devices.check_alike(WorkerContext.from_process_group(), allow_mixed=False)
    if rank == 0:
        Path(out).write_text(json.dumps(found))
    dist.barrier()  # no rank tears down while another still talks


def test_every_rank_reports_its_device_and_alike_ones_pass(tmp_path):
    out = str(tmp_path / "devices.json")
    spawn_ranks(_gather_worker, 2, (out,), timeout=120)
    found = json.loads(Path(out).read_text())
    assert len(found) == 2 and found[0] == found[1] == devices.describe(torch.device("cpu"))
    assert found[0]["memory_gib"] > 0 and found[0]["capability"] == "cpu"


@pytest.mark.slow
def test_an_out_of_memory_is_one_line_with_rank_step_and_what_to_try(tmp_path):
    proc = run_cli(
        "train",
        "--set",
        "scaling.num_workers=0",
        "--set",
        f"run.storage_path={tmp_path}",
        "--set",
        "tracking.enabled=false",
        "--set",
        "faults.oom_at_step=3",
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rayjobs: training failed: OutOfMemory: rank 0 ran out of memory at step 3 (process RSS ")
    assert "can't allocate memory" in last
    assert last.endswith(
        "try a smaller micro-batch (training.batch_size, or more training.grad_accum); or parallel.strategy=fsdp "
        "(shards parameters, gradients and optimizer state); or parallel.activation_checkpointing=full"
    )
    assert "memory estimate per rank (ddp: one rank)" in proc.stdout
