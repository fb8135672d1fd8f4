"""`model.name: hf:<dir>`: a transformers causal LM from a local config.json (a tiny GPT-2 written here,
nothing downloaded) checked before Ray, trained under DDP and FSDP2 on 2 gloo ranks with the losses of
one process, sharded layer by layer, saved through DCP and exported."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import checkpoint_weights, run_cli, spawn_ranks, tiny_gpt2

from models import build_model, parallel_plan
from rayjobs import parallel, paths, stepping, tasks
from rayjobs.checkpoint import Saver, TrainState
from rayjobs.config import load_config
from rayjobs.context import WorkerContext
from rayjobs.data import data_info

pytest.importorskip("transformers")

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 4, 8, 16, 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A 2-layer GPT-2 config (no dropout, so ranks and one process compute the same)."""
    return tiny_gpt2(tmp_path_factory.mktemp("hf") / "tiny-gpt2")


def _cfg(tiny: Path, strategy: str):
    return load_config(
        None,
        [
            f"model.name=hf:{tiny}",
            "data.name=synthetic",
            f"data.kwargs={{kind: tokens, seq_len: {SEQ}, vocab_size: {VOCAB}}}",
            "optim.lr=0.01",
            "optim.grad_clip=0.5",
            f"training.batch_size={GLOBAL_BATCH}",
            f"parallel.strategy={strategy}",
            "tracking.enabled=false",
        ],
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _model(cfg) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(
        cfg.model.name, cfg.model.flavor, cfg.model.kwargs, data_info(cfg.data.name, cfg.data.kwargs)
    ).double()


def _worker(rank: int, world: int, port: int, tiny: str, strategy: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    from torch.distributed.fsdp import FSDPModule

    cfg = _cfg(Path(tiny), strategy)
    ctx, layout = parallel.place(cfg, WorkerContext.from_process_group())
    par = parallel.apply(_model(cfg), cfg, ctx, layout, tasks.LanguageModel().loss)
    opt = stepping.build_optimizer(par.model, cfg)
    per = GLOBAL_BATCH // world
    losses = [
        stepping.train_step(
            par.model, [(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per])], opt, cfg, ctx
        ).loss
        for x, y in _batches()
    ]
    inner = par.model.module if isinstance(par.model, torch.nn.parallel.DistributedDataParallel) else par.model
    layers = inner.get_submodule(parallel_plan(cfg.model.name).layers_attr)
    saver = Saver(out, ctx, cfg.model_dump(mode="json"), keep_last=1)
    path = saver.save(STEPS, par.model, opt, stepping.build_scheduler(opt, cfg, 100), None, TrainState(step=STEPS))
    saver.wait()
    if rank == 0:
        sharded = [isinstance(layer, FSDPModule) for layer in layers]
        Path(out, "result.json").write_text(json.dumps({"losses": losses, "sharded": sharded, "checkpoint": path}))
    dist.barrier()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_transformers_model_trains_under_ddp_and_fsdp_like_one_process(tiny, strategy, tmp_path):
    cfg = _cfg(tiny, strategy)
    assert parallel_plan(cfg.model.name).layers_attr == "model.transformer.h"
    model = _model(cfg)
    opt = stepping.build_optimizer(model, cfg)
    one = WorkerContext(0, 1, 0, torch.device("cpu"))
    reference = [stepping.train_step(model, [(x, y)], opt, cfg, one).loss for x, y in _batches()]
    assert reference[-1] < reference[0]  # it learns
    spawn_ranks(_worker, 2, (str(tiny), strategy, str(tmp_path)), timeout=240)
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["losses"] == pytest.approx(reference, rel=1e-9)
    assert got["sharded"] == ([True, True] if strategy == "fsdp" else [False, False])  # FSDP2 unit per layer
    weights = checkpoint_weights(got["checkpoint"])  # a registry-free model that needs no --trust-model
    assert weights["model.transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    expected = {k: v.float() for k, v in model.state_dict().items()}
    for key in ("model.transformer.wte.weight", "model.transformer.h.1.mlp.c_proj.weight"):
        torch.testing.assert_close(weights[key], expected[key], rtol=1e-5, atol=1e-6)


def test_an_hf_model_is_checked_before_ray_and_its_directory_made_absolute(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tiny.parent)
    cfg = load_config(
        None, ["model.name=hf:tiny-gpt2", "data.name=synthetic", "data.kwargs={kind: tokens, seq_len: 32}"]
    )
    paths.resolve(cfg)
    assert cfg.model.name == f"hf:{tiny}" and paths.relative_paths(cfg) == []
    for args, line in [
        (["--set", "model.name=hf:nowhere"], f"model.name: hf:nowhere: no config.json in {tmp_path / 'nowhere'} "
         "(a transformers model directory; nothing is downloaded)"),
        (["--set", f"model.name=hf:{tiny}"], f"model.name: hf:{tiny} is a causal LM: it needs tokens data, but "
         "data.name=digits gives image; tokens come from data.name=text (a folder of .txt files), a Parquet of "
         "token ids (`rayjobs data prepare text`), or data.name=synthetic with data.kwargs.kind=tokens (--config gpt-synthetic)"),
        (["--set", f"model.name=hf:{tiny}", "--set", "data.name=synthetic", "--set", "data.kwargs={kind: tokens, seq_len: 32}",
          "--set", "parallel.strategy=tp", "--set", "scaling.num_workers=2"],
         f"parallel.strategy=tp: hf:{tiny} trains under ddp, fsdp and hsdp; tensor and pipeline parallel need a "
         "plan that a transformers model does not carry here"),
        (["--set", f"model.name=hf:{tiny}", "--set", "data.name=synthetic", "--set",
          "data.kwargs={kind: tokens, seq_len: 16, vocab_size: 512}"],
         f"model.name: hf:{tiny}: vocab_size 256 is smaller than the data's 512 tokens; set model.kwargs.vocab_size=512"),
        (["--set", f"model.name=hf:{tiny}", "--set", "data.name=synthetic", "--set",
          "data.kwargs={kind: tokens, seq_len: 100}"],
         f"model.name: hf:{tiny}: 64 positions, but the data's sequences are 100 long; shorten data.kwargs.seq_len "
         "or raise the model's positions"),
        (["--set", f"model.name=hf:{tiny}", "--set", "data.name=synthetic", "--set",
          "data.kwargs={kind: tokens, seq_len: 16}", "--set", "model.kwargs={n_layers: 4}"],
         f"model.kwargs: hf:{tiny}: n_layers is not a field of its gpt2 config; did you mean model.kwargs.n_layer?"),
    ]:  # fmt: skip
        proc = run_cli("train", *args, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == f"rayjobs: error: {line}", proc.stderr


def test_rayjobs_train_runs_an_hf_model_in_local_mode(tiny, tmp_path):
    proc = run_cli(
        "train", "--set", f"model.name=hf:{tiny}", "--set", "data.name=synthetic", "--set",
        "data.kwargs={kind: tokens, seq_len: 32, vocab_size: 256}", "--set", "scaling.num_workers=0", "--set",
        "training.max_steps=20", "--set", "training.eval_every=10", "--set", "optim.lr=0.003", "--set",
        "model.kwargs={layer_norm_epsilon: 1.0e-5, num_hidden_layers: 2}",  # fields not in config.json: fine
        "--set", "tracking.enabled=false", "--summary", str(tmp_path / "s.json"), cwd=tmp_path, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    history = [
        json.loads(line)
        for line in Path(json.loads((tmp_path / "s.json").read_text())["history"]).read_text().splitlines()
    ]
    evals = [h["val/loss"] for h in history if "val/loss" in h]
    assert len(evals) >= 2 and evals[-1] < evals[0] < 6.0, evals
