"""DDP over 2 gloo processes (no Ray) ends with the same parameters as one process on the global batch.

Both sides run in float64, so the only difference left is the order of floating-point sums:
the tolerance (1e-10) is tight enough that any error in loss normalization or accumulation fails.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from models import DataInfo, build_model
from rayjobs import stepping
from rayjobs.config import from_dict
from rayjobs.context import WorkerContext
from rayjobs.parallel import wrap_ddp

STEPS, GLOBAL_BATCH = 5, 16
CASES = {
    "mlp": (DataInfo("image", (1, 8, 8), 10), {"name": "sgd", "lr": 0.1}),
    "gpt": (DataInfo("tokens", (12,), 32), {"name": "adamw", "lr": 0.01}),
}


def _data(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    info = CASES[name][0]
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        if info.kind == "tokens":
            x = torch.randint(0, info.num_classes, (GLOBAL_BATCH, *info.input_shape), generator=g)
            y = torch.randint(0, info.num_classes, (GLOBAL_BATCH, *info.input_shape), generator=g)
        else:
            x = torch.randn(GLOBAL_BATCH, *info.input_shape, generator=g, dtype=torch.float64)
            y = torch.randint(0, info.num_classes, (GLOBAL_BATCH,), generator=g)
        out.append((x, y))
    return out


def _train(name: str, ctx: WorkerContext, accum: int) -> torch.nn.Module:
    info, optim = CASES[name]
    cfg = from_dict({"optim": optim, "training": {"grad_accum": accum}})
    torch.manual_seed(0)
    model = wrap_ddp(build_model(name, "debug", {}, info).double(), ctx)
    opt = stepping.build_optimizer(model, cfg)
    per_rank = GLOBAL_BATCH // ctx.world_size
    for x, y in _data(name):
        xs, ys = x[ctx.rank * per_rank : (ctx.rank + 1) * per_rank], y[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]
        stepping.train_step(model, list(zip(xs.chunk(accum), ys.chunk(accum))), opt, cfg, ctx)
    return model


def _worker(rank: int, world: int, port: int, name: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    ctx = WorkerContext.from_process_group()
    model = _train(name, ctx, accum=2)
    if rank == 0:
        torch.save(model.module.state_dict(), out)
    dist.barrier()  # both ranks done before either tears the group down


@pytest.mark.parametrize("name", sorted(CASES))
def test_ddp_two_processes_match_one_process_on_the_global_batch(name: str, tmp_path):
    from conftest import spawn_ranks

    out = str(tmp_path / "ddp.pt")
    spawn_ranks(_worker, 2, (name, out))
    ddp = torch.load(out, weights_only=True)
    reference = _train(name, WorkerContext(0, 1, 0, torch.device("cpu")), accum=1).state_dict()
    assert ddp.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(ddp[key], reference[key], rtol=0, atol=1e-10, msg=key)
    torch.manual_seed(0)
    initial = build_model(name, "debug", {}, CASES[name][0]).double()
    assert any(not torch.equal(initial.state_dict()[k], reference[k]) for k in reference)  # it trained


def gpt_ddp(ctx: WorkerContext) -> tuple:
    """gpt/debug under DDP with its optimizer, scheduler and config (seeded): what the checkpoint tests train."""
    info, optim = CASES["gpt"]
    cfg = from_dict({"optim": optim})
    torch.manual_seed(0)
    model = wrap_ddp(build_model("gpt", "debug", {}, info), ctx)
    opt = stepping.build_optimizer(model, cfg)
    return model, opt, stepping.build_scheduler(opt, cfg, 10), cfg


def _async_saver_worker(rank: int, world: int, port: int, root: str) -> None:
    from rayjobs.checkpoint import Saver, TrainState

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    ctx = WorkerContext.from_process_group()
    model, opt, sched, cfg = gpt_ddp(ctx)
    saver = Saver(root, ctx, {}, keep_last=2, async_save=True)
    for step, (x, y) in enumerate(_data("gpt")[:3], start=1):
        per = GLOBAL_BATCH // world
        stepping.train_step(
            model, [(x[rank * per : (rank + 1) * per].long(), y[rank * per : (rank + 1) * per])], opt, cfg, ctx
        )
        saver.save(step, model, opt, sched, None, TrainState(step=step))  # DDP keeps running meanwhile
    saver.wait()
    dist.barrier()


def test_async_checkpoints_from_two_ranks_commit_while_ddp_trains(tmp_path):
    from conftest import spawn_ranks

    from rayjobs import checkpoint as ckpt

    spawn_ranks(_async_saver_worker, 2, (str(tmp_path),))
    infos = ckpt.list_checkpoints(tmp_path)
    assert [c.step for c in infos] == [2, 3] and all(c.complete for c in infos), infos
    assert {p.name for p in Path(infos[-1].path).glob("rank_*.pt")} == {"rank_0.pt", "rank_1.pt"}


def _buffers_worker(rank: int, world: int, port: int, root: str) -> None:
    from rayjobs.checkpoint import Saver, TrainState

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    ctx = WorkerContext.from_process_group()
    info = DataInfo("image", (1, 8, 8), 10)
    cfg = from_dict({"model": {"name": "digits_cnn", "flavor": "debug"}, "optim": {"name": "sgd", "lr": 0.1}})
    torch.manual_seed(0)
    model = wrap_ddp(build_model("digits_cnn", "debug", {}, info), ctx)  # BatchNorm inside
    opt = stepping.build_optimizer(model, cfg)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own batches: its own running statistics
    for _ in range(3):
        x, y = torch.randn(8, 1, 8, 8, generator=g) * (1 + rank), torch.randint(0, 10, (8,), generator=g)
        stepping.train_step(model, [(x, y)], opt, cfg, ctx)
    mine = {k: v.clone() for k, v in model.module.named_buffers()}
    theirs = [None] * world
    dist.all_gather_object(theirs, mine)
    Saver(root, ctx, cfg.model_dump(mode="json"), keep_last=1).save(
        3, model, opt, stepping.build_scheduler(opt, cfg, 3), None, TrainState(step=3)
    )
    if rank == 0:
        torch.save({"rank0": theirs[0], "rank1": theirs[1]}, Path(root) / "buffers.pt")
    dist.barrier()


def test_a_checkpoint_holds_rank_zeros_buffers(tmp_path):
    """BatchNorm statistics differ per rank between DDP's broadcasts; a save stores rank 0's, which
    every rank would hold at the next forward, so a resumed run continues exactly."""
    from conftest import checkpoint_weights, spawn_ranks

    from rayjobs import checkpoint as ckpt

    spawn_ranks(_buffers_worker, 2, (str(tmp_path),))
    seen = torch.load(tmp_path / "buffers.pt", weights_only=True)
    running = [k for k in seen["rank0"] if "running" in k]
    assert running and any(not torch.equal(seen["rank0"][k], seen["rank1"][k]) for k in running)  # they differ
    saved = checkpoint_weights(ckpt.list_checkpoints(tmp_path)[-1].path)
    for key, value in seen["rank0"].items():
        assert torch.equal(saved[key], value), key
