"""Every parallel strategy on gloo CPU processes (no Ray): gpt debug trains a few steps with the
losses of one process on the global batch, evaluates the same, saves through DCP, and reloads.

Both sides run in float64 with gradient clipping active, so a wrong gradient reduction, a wrong
norm across shards or stages, or a wrong data shard shows as a loss difference far above the
tolerance (1e-9 relative), which only covers the order of floating-point sums.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import checkpoint_weights, spawn_ranks
from torch.utils.data import TensorDataset

from models import build_model
from rayjobs import checkpoint as ckpt
from rayjobs import parallel, stepping, tasks
from rayjobs.checkpoint import Saver, TrainState
from rayjobs.config import from_dict
from rayjobs.context import WorkerContext
from rayjobs.data import data_info

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 4, 8, 16, 32
RTOL = 1e-9

CASES = {
    "ddp": (2, {}),
    "fsdp": (2, {"activation_checkpointing": "full"}),
    "tp": (2, {}),
    "pp": (2, {"pp_schedule": "gpipe"}),
    "hsdp": (4, {"dp_replicate": 2}),
    "fsdp+tp": (4, {}),
    "pp+dp": (4, {"pp_schedule": "1f1b"}),
    # A user's model (tests/user_model.py, outside models/) split by the plan its builder carries.
    "tp:user_gpt": (2, {}),
    "pp:user_gpt": (2, {"pp_schedule": "gpipe"}),
}


def _cfg(strategy: str, extra: dict) -> object:
    strategy, _, user_model = strategy.partition(":")
    model = {"name": f"user_model:{user_model}", "kwargs": {"vocab_size": VOCAB, "seq_len": SEQ}}
    return from_dict(
        {
            "model": model if user_model else {"name": "gpt", "flavor": "debug"},
            "data": {"name": "synthetic", "kwargs": {"kind": "tokens", "seq_len": SEQ, "vocab_size": VOCAB}},
            "optim": {"name": "adamw", "lr": 0.01, "grad_clip": 0.5},
            "training": {"batch_size": GLOBAL_BATCH},
            "parallel": {"strategy": strategy, **extra},
            "tracking": {"enabled": False},
        }
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS + 1)
    ]


def _eval_set() -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(
        torch.randint(0, VOCAB, (20, SEQ), generator=g), torch.randint(0, VOCAB, (20, SEQ), generator=g)
    )


def _model(cfg, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(
        cfg.model.name, cfg.model.flavor, cfg.model.kwargs, data_info(cfg.data.name, cfg.data.kwargs)
    ).double()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _worker(rank: int, world: int, port: int, strategy: str, extra: dict, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    cfg = _cfg(strategy, extra)
    ctx, layout = parallel.place(cfg, WorkerContext.from_process_group())
    shard, shards = ctx.data_shard
    per = GLOBAL_BATCH // shards

    def parallelized(seed: int):
        par = parallel.apply(_model(cfg, seed), cfg, ctx, layout, tasks.LanguageModel().loss)
        return par, stepping.build_optimizer(par.model, cfg)

    def step(par, opt, x, y):
        return stepping.train_step(
            par.model,
            [(x[shard * per : (shard + 1) * per], y[shard * per : (shard + 1) * per])],
            opt,
            cfg,
            ctx,
            pipeline=par.pipeline,
        )

    par, opt = parallelized(0)
    batches = _batches()
    results = [step(par, opt, x, y) for x, y in batches[: STEPS - 1]]
    # Sharded and TP states are DTensors: save them async, the first save still being written during
    # the last step, the second staged into the copy the first allocated.
    async_save = layout.sharded or layout.tp > 1
    saver = Saver(out, ctx, cfg.model_dump(mode="json"), keep_last=1, async_save=async_save)
    sched = stepping.build_scheduler(opt, cfg, 100)
    if async_save:
        saver.save(STEPS - 1, par.model, opt, sched, None, TrainState(step=STEPS - 1))
    results.append(step(par, opt, *batches[STEPS - 1]))
    evaluated = stepping.evaluate(par.model, _eval_set(), cfg, ctx, "val", pipeline=par.pipeline)
    saver.save(STEPS, par.model, opt, sched, None, TrainState(step=STEPS))
    saver.close()
    path = str(Path(out) / ckpt.name_for(STEPS))

    again, opt2 = parallelized(seed=7)  # other weights, then the checkpoint over them
    ckpt.load(path, again.model, opt2, ctx)
    same = all(
        torch.equal(_local(a), _local(b))
        for a, b in zip(par.model.state_dict().values(), again.model.state_dict().values())
    )
    x, y = batches[STEPS]
    after = [step(par, opt, x, y).loss, step(again, opt2, x, y).loss]
    if rank == 0:
        Path(out, "result.json").write_text(
            json.dumps(
                {
                    "losses": [r.loss for r in results],
                    "grad_norms": [r.grad_norm for r in results],
                    "val_loss": evaluated["val/loss"],
                    "val_accuracy": evaluated["val/accuracy"],
                    "reloaded_equal": same,
                    "after_reload": after,
                    "checkpoint": path,
                    "layout": layout.describe(),
                }
            )
        )
    dist.barrier()  # no rank tears down while another still talks


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, the whole global batch per step."""
    cfg = _cfg("ddp", {})
    model = _model(cfg)
    opt = stepping.build_optimizer(model, cfg)
    ctx = WorkerContext(0, 1, 0, torch.device("cpu"))
    results = [stepping.train_step(model, [(x, y)], opt, cfg, ctx) for x, y in _batches()[:STEPS]]
    evaluated = stepping.evaluate(model, _eval_set(), cfg, ctx, "val")
    return {
        "losses": [r.loss for r in results],
        "grad_norms": [r.grad_norm for r in results],
        "val_loss": evaluated["val/loss"],
        "val_accuracy": evaluated["val/accuracy"],
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


@pytest.mark.parametrize("strategy", list(CASES))
def test_strategy_matches_one_process_and_reloads(strategy, reference, tmp_path):
    world, extra = CASES[strategy]
    spawn_ranks(_worker, world, (strategy, extra, str(tmp_path)), timeout=240)
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["losses"] == pytest.approx(reference["losses"], rel=RTOL), got["layout"]
    assert got["grad_norms"] == pytest.approx(reference["grad_norms"], rel=RTOL)
    assert reference["grad_norms"][0] > 0.5  # clipping was active: the clip saw the global norm
    assert got["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-6)  # evaluate sums in float32
    assert got["val_accuracy"] == pytest.approx(reference["val_accuracy"])
    assert got["reloaded_equal"], "the reloaded model differs from the saved one"
    assert got["after_reload"][0] == got["after_reload"][1]  # optimizer state came back too
    # The checkpoint loads in one process with no strategy (DCP reshards): the reference's weights
    # (export builds the model in float32, so the comparison is at float32 precision).
    user_model = f"user_model:{strategy.partition(':')[2]}" if ":" in strategy else ""
    weights = checkpoint_weights(got["checkpoint"], user_model)
    assert weights.keys() == reference["weights"].keys()
    for k, v in reference["weights"].items():
        torch.testing.assert_close(weights[k].double(), v, rtol=1e-6, atol=1e-7, msg=f"{strategy}: {k}")


@pytest.mark.slow
def test_compile_and_checkpointing_keep_the_losses_and_the_checkpoint_names(tmp_path):
    """torch.compile per block with selective activation checkpointing, in local mode: the same
    losses as plain eager (within compile's reordering of float sums) and the same checkpoint keys."""
    from rayjobs import train
    from rayjobs.config import CONFIG_DIR, load_config

    runs = {}
    for name, extra in (
        ("eager", []),
        ("compiled", ["parallel.compile=true", "parallel.activation_checkpointing=selective"]),
    ):
        cfg = load_config(
            CONFIG_DIR / "gpt-fsdp.yaml",
            [
                f"run.storage_path={tmp_path}",
                f"run.name={name}",
                "model.flavor=debug",
                "scaling.num_workers=0",
                "training.max_steps=4",
                "training.eval_every=2",
                "tracking.enabled=false",
                *extra,
            ],
        )
        runs[name] = train.run(cfg)
    eager, compiled = (runs[k]["metrics"] for k in ("eager", "compiled"))
    assert compiled["train/loss"] == pytest.approx(eager["train/loss"], rel=1e-4)
    assert compiled["val/loss"] == pytest.approx(eager["val/loss"], rel=1e-4)
    a, b = (checkpoint_weights(runs[k]["checkpoint"]) for k in ("eager", "compiled"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-5)


def test_dataparallel_is_one_worker_and_recommends_ddp(capsys):
    cfg = _cfg("dataparallel", {})
    ctx, layout = parallel.place(cfg, WorkerContext(0, 1, 0, torch.device("cpu")))
    par = parallel.apply(_model(cfg), cfg, ctx, layout, tasks.LanguageModel().loss)
    # On CPU there is one device: the model itself; with several GPUs, nn.DataParallel over all of them.
    expected = torch.nn.DataParallel if torch.cuda.device_count() > 1 else type(_model(cfg))
    assert isinstance(par.model, expected)
    assert "prefer ddp (one process per GPU)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="one worker drives all GPUs of its node, but the run has 2 workers"):
        parallel.resolve_layout(cfg.parallel, 2)
