"""The house's joints: the LaunchPlan contract, RunDir's ledgers, the strategy table, the Store protocol, the Meter."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import REPO
from torch import nn

from models import ParallelPlan, get_spec, parallel_plan
from rayjobs import config, parallel
from rayjobs.plan import LaunchPlan, StreamPlan, TrackingPlan
from rayjobs.rundir import RunDir, read_history
from rayjobs.storage import LocalStore
from rayjobs.telemetry import Meter


def test_a_launch_plan_crosses_as_a_plain_dict_and_comes_back_equal():
    plan = LaunchPlan(
        config=config.load_config(None, []).model_dump(mode="json"),
        use_gpu=False,
        cpus_per_worker=0.5,
        stop_at_step=40,
        tracking=TrackingPlan(None, "/r/run", "/r/run/.mlflow-spool.jsonl"),
        stream=StreamPlan("image", (1, 8, 8), 10, 1257, True, 2, True),
    )
    wire = json.loads(json.dumps(plan.to_dict()))  # what Ray serializes is plain data
    assert LaunchPlan.from_dict(wire) == plan
    with pytest.raises(TypeError, match="unknown keys \\['_resolved'\\]"):
        LaunchPlan.from_dict({**wire, "_resolved": {}})


def test_a_run_dir_names_every_ledger_and_reads_back_what_was_written(tmp_path):
    rundir = RunDir(str(tmp_path / "run"))
    assert {rundir.metrics, rundir.events, rundir.spool, rundir.attempts, rundir.exploits} == {
        str(tmp_path / "run" / n)
        for n in ("metrics.jsonl", "events.jsonl", ".mlflow-spool.jsonl", ".attempts", "pbt_exploits.jsonl")
    }
    rundir.append_history({"step": 10, "val/loss": 0.5, "note": "text is dropped"})
    rundir.append_history({"step": 20, "val/loss": 0.4})
    rundir.append_history({"step": 10, "val/loss": 0.45})  # replayed after a resume: the last one counts
    assert [(h["step"], h["val/loss"]) for h in rundir.read_history()] == [(10, 0.45), (20, 0.4)]
    assert read_history(rundir.metrics) == rundir.read_history()
    before = time.time()
    rundir.record_event("first_step", step=1)
    rundir.record_event("trial_start")
    (event,) = rundir.read_events("first_step")
    assert event["step"] == 1 and event["time"] >= before
    assert [rundir.next_attempt() for _ in range(3)] == [1, 2, 3]
    rundir.record_exploit({"trial_id": "a", "cloned_from": "b", "step": 5})
    assert rundir.read_exploits() == [{"trial_id": "a", "cloned_from": "b", "step": 5}]


def test_every_strategy_name_in_the_config_is_a_row_of_the_strategy_table():
    assert set(config.STRATEGIES) == set(parallel.STRATEGIES)
    assert parallel.elastic_strategies() == ["ddp", "fsdp"]
    assert {s.name for s in parallel.STRATEGIES.values() if s.model_parallel} == {"tp", "pp", "fsdp+tp", "pp+dp"}
    assert {s.name for s in parallel.STRATEGIES.values() if s.sharded} == {"fsdp", "hsdp", "fsdp+tp"}


def test_the_layout_answers_coordinates_stage_bounds_and_what_tp_shards():
    p = config.load_config(None, ["parallel.strategy=fsdp+tp", "parallel.tp=2"]).parallel
    layout = parallel.resolve_layout(p, 4)
    assert (layout.dp_shard, layout.tp, layout.sharded, layout.elastic) == (2, 2, True, False)
    assert [layout.coordinates(r) for r in range(4)] == [
        {"tp": 0, "dp_shard": 0, "dp_replicate": 0, "pp": 0},
        {"tp": 1, "dp_shard": 0, "dp_replicate": 0, "pp": 0},
        {"tp": 0, "dp_shard": 1, "dp_replicate": 0, "pp": 0},
        {"tp": 1, "dp_shard": 1, "dp_replicate": 0, "pp": 0},
    ]
    pp = parallel.resolve_layout(config.load_config(None, ["parallel.strategy=pp"]).parallel, 3)
    assert pp.stage_bounds(7) == [0, 3, 5, 7] and not pp.same_buffers
    model = parallel.meta_model(
        config.load_config(
            None, ["model.name=gpt", "model.flavor=debug", "data.name=synthetic", "data.kwargs.kind=tokens"]
        )
    )
    sharded = layout.tp_sharded(model, parallel_plan("gpt").tp_plan)
    assert sharded[:4] == [
        "layers.0.attn.q_proj",
        "layers.0.attn.k_proj",
        "layers.0.attn.v_proj",
        "layers.0.attn.o_proj",
    ]
    assert len(sharded) == 2 * 6  # q, k, v, o, up, down per block; in the model's order on every rank


def test_a_model_spec_carries_its_parallel_plan_as_typed_data():
    plan = get_spec("gpt").parallel
    assert isinstance(plan, ParallelPlan) and plan.layers_attr == "layers" and plan.can_pipeline
    assert plan.pipeline_first == ("tok_embeddings", "pos_embeddings") and plan.pipeline_last == ("norm", "output")
    assert parallel_plan("digits_cnn") == ParallelPlan() and parallel_plan("user_model:build_tiny") == ParallelPlan()
    assert parallel_plan("user_model:user_gpt").layers_attr == "layers"  # a user's builder carries its own


def test_a_local_store_is_files_and_directories_written_whole(tmp_path):
    store = LocalStore(tmp_path / "run")
    assert store.dirs() == [] and store.read_bytes("x") is None
    store.write_bytes("checkpoint_00000001/state.json", b"{}")
    store.write_bytes("checkpoint_00000002/manifest.json", b"{}")
    assert store.dirs() == ["checkpoint_00000001", "checkpoint_00000002"]
    assert store.files("checkpoint_00000001") == {"state.json": 2}
    assert not list((tmp_path / "run" / "checkpoint_00000001").glob("*.tmp"))
    src = tmp_path / "w.bin"
    src.write_bytes(b"abc")
    store.upload(src, "checkpoint_00000002/w.bin")
    store.download("checkpoint_00000002/w.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == b"abc"
    store.remove("checkpoint_00000002/manifest.json")
    store.remove("checkpoint_00000002/manifest.json")  # already gone: nothing happens
    store.delete_dir("checkpoint_00000002")
    assert store.dirs() == ["checkpoint_00000001"] and store.url("a") == str(tmp_path / "run" / "a")


def test_the_meter_reports_only_every_log_every_steps_and_mfu_against_the_job_peak():
    meter = Meter(flops_per_sample=1e6, job_peak=1e9, batch_size=10, tokens_per_sample=4, log_every=5, first_step=1)
    meter.step_started()
    assert meter.step_metrics(3, 0.5, 1e-3, 1.0, 0.0) == {}
    time.sleep(0.01)
    m = meter.step_metrics(5, 0.5, 1e-3, 1.0, 0.001)
    assert m["perf/samples_per_s"] == pytest.approx(10 / m["perf/step_time_s"])
    assert m["perf/mfu"] == pytest.approx(1e6 * m["perf/samples_per_s"] / 1e9)
    assert m["perf/tokens_per_s"] == pytest.approx(4 * m["perf/samples_per_s"])
    assert meter.samples_per_s() == 0.0  # no step done yet: no throughput, not samples / 0
    meter.step_done()
    assert meter.train_s > 0 and "eta" in meter.progress(5, 10, 10, 0, 0.5, 1e-3)
    assert meter.samples == 10 and meter.samples_per_s() == pytest.approx(10 / meter.train_s)


def test_the_worker_recipe_reads_in_one_screen():
    import ast
    import inspect

    from rayjobs import loop

    tree = ast.parse(inspect.getsource(loop))
    lengths = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert lengths["train"] <= 60, lengths
    assert max(lengths.values()) <= 80, lengths


def test_no_function_in_rayjobs_is_over_80_lines():
    import ast

    from conftest import REPO

    long = []
    for path in (REPO / "rayjobs").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{path.relative_to(REPO)}:{node.name} ({node.end_lineno - node.lineno + 1})")
    assert not long, long


def test_a_strategy_row_is_all_a_new_replicated_layout_needs(monkeypatch):
    """A new strategy is a row (plus its name in the config's list): resolve, place and apply follow from it."""
    from rayjobs.context import WorkerContext
    from rayjobs.parallel.layout import STRATEGIES, Strategy

    monkeypatch.setitem(STRATEGIES, "replicas", Strategy("replicas", frozenset({"dp_replicate"}), "dp_replicate"))
    monkeypatch.setattr(config, "STRATEGIES", (*config.STRATEGIES, "replicas"))
    p = config.ParallelSection.model_construct(**{**config.ParallelSection().model_dump(), "strategy": "replicas"})
    layout = parallel.resolve_layout(p, 2)
    assert (layout.dp_replicate, layout.dp, layout.sharded, layout.elastic) == (2, 2, False, False)
    cfg = config.load_config(None, ["model.name=mlp", "model.flavor=debug"])
    object.__setattr__(cfg, "parallel", p)
    ctx, layout = parallel.place(cfg, WorkerContext(0, 1, 0, torch.device("cpu")))
    par = parallel.apply(nn.Linear(2, 2), cfg, ctx, layout)
    assert isinstance(par.model, nn.Linear)  # one process: nothing to wrap


def test_no_source_file_is_hidden_from_git_by_an_ignore_pattern():
    """A `.gitignore` pattern once matched tests/dist/, so a new test there was never committed and CI
    never ran it. Every source file in the repo's own folders is either tracked or merely untracked."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    folders = ["rayjobs", "models", "benchmarks", "tests", "cluster", ".ci"]
    proc = subprocess.run(
        ["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--", *folders],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    hidden = [p for p in proc.stdout.split() if "__pycache__" not in p and not p.endswith(".pyc")]
    assert not hidden, f"ignored by .gitignore, so never committed: {hidden}"
