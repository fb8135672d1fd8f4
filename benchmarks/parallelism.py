"""FSDP2 memory: per-rank parameter + gradient + optimizer bytes under FSDP2 on 2 ranks against DDP's.

Measured, not estimated: after one AdamW step each rank adds up the bytes of the tensors it holds
(local shards of parameters, gradients and optimizer state). The estimate printed before training
(``rayjobs.memory``) is shown beside it.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.base import Benchmark, Figure, Size, register, run_rank_then_exit

SEQ, BATCH = 64, 4


def _cfg(strategy: str, flavor: str):
    from rayjobs.config import from_dict

    return from_dict(
        {
            "model": {"name": "gpt", "flavor": flavor},
            "data": {"name": "synthetic", "kwargs": {"kind": "tokens", "seq_len": SEQ, "vocab_size": 256}},
            "optim": {"name": "adamw", "lr": 1e-4},
            "training": {"batch_size": BATCH * 2},
            "parallel": {"strategy": strategy},
            "tracking": {"enabled": False},
        }
    )


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _worker(rank: int, port: int, strategy: str, flavor: str, out: str) -> None:
    from models import build_model
    from rayjobs import parallel, stepping, tasks
    from rayjobs.context import WorkerContext
    from rayjobs.data import data_info

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=300)
    )
    cfg = _cfg(strategy, flavor)
    ctx, layout = parallel.place(cfg, WorkerContext.from_process_group())
    torch.manual_seed(0)
    model = build_model("gpt", flavor, {}, data_info(cfg.data.name, cfg.data.kwargs))
    par = parallel.apply(model, cfg, ctx, layout, tasks.LanguageModel().loss)
    opt = stepping.build_optimizer(par.model, cfg)
    x = torch.randint(0, 256, (BATCH, SEQ))
    # Gradients are kept (no zero_grad) so that they are counted: set_to_none would free them.
    loss = tasks.LanguageModel().loss(par.model(x), torch.roll(x, -1, 1))
    loss.backward()
    opt.step()
    params = sum(_local_bytes(p) for p in par.model.parameters())
    grads = sum(_local_bytes(p.grad) for p in par.model.parameters())
    states = sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    if rank == 0:
        Path(out).write_text(json.dumps({"params": params, "grads": grads, "optimizer": states}))
    dist.barrier()  # no rank tears down while another still talks


def measure(strategy: str, flavor: str) -> dict[str, int]:
    """Bytes rank 0 holds after one step under ``strategy`` on 2 gloo processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        mp.start_processes(
            run_rank_then_exit, args=(_worker, port, strategy, flavor, out), nprocs=2, start_method="spawn"
        )
        return json.loads(Path(out).read_text())


def run(size: Size) -> list[Figure]:
    """DDP then FSDP2, 2 ranks each; the ratio of what rank 0 holds, and the estimate's ratio."""
    from rayjobs.memory import estimate
    from rayjobs.parallel import resolve_layout

    flavor = size.pick("small", "debug")
    ddp, fsdp = measure("ddp", flavor), measure("fsdp", flavor)
    total_ddp, total_fsdp = sum(ddp.values()), sum(fsdp.values())
    est = {
        s: estimate(_cfg(s, flavor), resolve_layout(_cfg(s, flavor).parallel, 2), False).states for s in ("ddp", "fsdp")
    }
    return [
        Figure(
            f"parallel.fsdp_state_memory_ratio_gpt_{flavor}",
            total_fsdp / total_ddp,
            "<= 0.55",
            note=(
                f"rank 0 holds {total_fsdp / 2**20:.1f} MiB (FSDP2) vs {total_ddp / 2**20:.1f} MiB (DDP) of "
                f"parameters + gradients + AdamW state; estimated ratio {est['fsdp'] / est['ddp']:.3f}"
            ),
        )
    ]


register(
    Benchmark(
        name="parallel",
        workload="gpt debug (quick) or small, one AdamW step on 2 gloo CPU processes, DDP then FSDP2",
        compares="per-rank parameter + gradient + optimizer-state bytes under FSDP2 against DDP",
        run=run,
    )
)
