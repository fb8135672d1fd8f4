"""MLflow as the system of record, against a real `mlflow server` on 127.0.0.1."""

from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from conftest import free_port, run_cli

from rayjobs import tracking, train
from rayjobs.config import load_config
from rayjobs.tracking import ATTEMPT_TAG, MODEL_URI_TAG, RUN_KEY_TAG, client, flatten


def _runs(uri: str, experiment: str):
    c = client(uri)
    exp = c.get_experiment_by_name(experiment)
    return c, (c.search_runs([exp.experiment_id]) if exp else [])


def _steps(c, run_id: str, key: str) -> list[int]:
    return [m.step for m in c.get_metric_history(run_id, key)]


@pytest.mark.ray
def test_two_workers_one_killed_make_exactly_one_mlflow_run(ray_cluster, mlflow_server, tmp_path):
    uri = mlflow_server["uri"]
    cfg = load_config(
        None,
        [
            f"run.storage_path={tmp_path}",
            "run.name=tracked",
            "scaling.num_workers=2",
            "training.epochs=2",
            "training.eval_every=10",
            "checkpoint.every_steps=10",
            f"tracking.uri={uri}",
            "tracking.experiment=e2e",
            "tracking.log_every=1",
            "tracking.register_as=digits-e2e",
            "tracking.log_checkpoints=all",
            "faults.kill_rank=1",
            "faults.kill_at_step=25",
            "failure.max_failures=1",
        ],
    )
    summary = train.run(cfg)
    c, runs = _runs(uri, "e2e")
    assert len(runs) == 1
    run = runs[0]
    assert summary["mlflow_run_id"] == run.info.run_id and run.info.status == "FINISHED"
    assert run.data.tags[RUN_KEY_TAG] == cfg.run_dir
    assert run.data.tags[ATTEMPT_TAG] == "2"  # the worker group was restarted once
    assert run.data.tags["world_size"] == "2" and run.data.tags["strategy"] == "ddp"
    assert {"ray.version", "torch.version", "mlflow.version", "device.type", "nodes"} <= set(run.data.tags)
    assert run.data.params["optim.lr"] == str(cfg.optim.lr)
    assert run.data.params == {k: v for k, v in flatten(cfg.model_dump(mode="json")).items()}

    # Every step logged exactly once, though steps 21-25 ran twice (before and after the kill).
    steps = _steps(c, run.info.run_id, "train/step_loss")
    assert steps == list(range(1, 39)), steps
    assert _steps(c, run.info.run_id, "val/accuracy") == [10, 20, 30, 38]
    assert "memory/rank1/cpu_rss_gib" in run.data.metrics and "test/accuracy" in run.data.metrics

    artifacts = {a.path for a in c.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "learning_curve.png", "checkpoints"} <= artifacts
    assert run.data.tags[MODEL_URI_TAG].startswith("models:/")
    kept = {a.path for a in c.list_artifacts(run.info.run_id, "checkpoints")}
    assert "checkpoints/checkpoint_00000038" in kept

    # The registered model loads and predicts like the trained model.
    import mlflow.pytorch

    from models import build_model
    from rayjobs import checkpoint as ckpt
    from rayjobs import data as data_lib
    from rayjobs.context import WorkerContext

    version = c.get_latest_versions("digits-e2e")[0]
    assert version.run_id == run.info.run_id
    mlflow.set_tracking_uri(uri)
    loaded = mlflow.pytorch.load_model(f"models:/digits-e2e/{version.version}")
    splits = data_lib.load("digits", {})
    trained = build_model("digits_cnn", "default", {}, splits.info)
    ckpt.load(summary["checkpoint"], trained, None, WorkerContext(0, 1, 0, torch.device("cpu")))
    x = splits.test[:32][0]
    trained.eval()
    with torch.no_grad():  # saved as "pt2" (torch.export): loads as a GraphModule, no pickled code
        np.testing.assert_allclose(loaded(x).numpy(), trained(x).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_server_down_for_30s_mid_run_loses_no_metric(tmp_path):
    from rayjobs import mlflow_server as server

    port, store = free_port(), tmp_path / "store"
    uri = f"http://127.0.0.1:{port}"
    proc = server.start(str(store), port)
    cfg = load_config(
        None,
        [
            f"run.storage_path={tmp_path}",
            "run.name=outage",
            "scaling.num_workers=0",
            "training.epochs=60",
            "training.eval_every=100",
            "checkpoint.every_epochs=0",
            "checkpoint.every_steps=500",
            f"tracking.uri={uri}",
            "tracking.experiment=outage",
            "tracking.log_every=5",
            "tracking.log_checkpoints=none",
        ],
    )
    outage: dict[str, float] = {}

    def break_the_server() -> None:
        nonlocal proc
        time.sleep(4)  # a few points reach the server first
        server.stop(proc)
        outage["down_at"] = time.monotonic()
        time.sleep(32)
        proc = server.start(str(store), port)
        outage["up_at"] = time.monotonic()

    chaos = threading.Thread(target=break_the_server)
    chaos.start()
    try:
        started = time.monotonic()
        summary = train.run(cfg)
        finished = time.monotonic()
    finally:
        chaos.join()
    try:
        assert outage["up_at"] - outage["down_at"] >= 30
        assert finished > outage["down_at"] + 30 or finished > outage["up_at"], "the run ended before the outage did"
        c, runs = _runs(uri, "outage")
        assert len(runs) == 1 and runs[0].info.run_id == summary["mlflow_run_id"]
        total = summary["metrics"]["step"]
        assert _steps(c, runs[0].info.run_id, "train/step_loss") == list(range(5, int(total) + 1, 5))
        assert not tracking.has_pending(tmp_path / "outage" / ".mlflow-spool.jsonl")
        assert started < outage["down_at"]
    finally:
        server.stop(proc)


def test_a_server_never_reached_is_not_waited_for_at_the_end(tmp_path, capfd):
    """A mistyped tracking.uri: the run trains and spools; its end tries the server once (it waited
    90 s for a server that had never answered), and the spooled metrics stay for the next run."""
    cfg = load_config(
        None,
        [
            f"run.storage_path={tmp_path}",
            "run.name=nowhere",
            "scaling.num_workers=0",
            "training.max_steps=6",
            "tracking.log_every=2",
            f"tracking.uri=http://127.0.0.1:{free_port()}",
        ],
    )
    started = time.monotonic()
    summary = train.run(cfg)
    elapsed = time.monotonic() - started
    assert summary["metrics"]["step"] == 6 and summary["mlflow_run_id"] is None
    out = "".join(capfd.readouterr())
    assert "is unavailable" in out and "could not finish the MLflow run" in out, out
    assert tracking.has_pending(tmp_path / "nowhere" / ".mlflow-spool.jsonl")
    assert elapsed < 60, f"the run took {elapsed:.0f} s: its end waited for a server that never answered"


@pytest.mark.slow
def test_basic_auth_refuses_anonymous_and_logs_with_credentials(tmp_path, monkeypatch):
    from rayjobs import mlflow_server as server

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "trainer")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-Passw0rd!")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    proc = server.start(str(tmp_path / "store"), port, auth=True)
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=10)
        assert info.value.code == 401
        cfg = load_config(
            None,
            [
                f"run.storage_path={tmp_path}",
                "run.name=authed",
                "scaling.num_workers=0",
                "training.epochs=1",
                "model.name=mlp",
                f"tracking.uri={uri}",
                "tracking.experiment=auth",
            ],
        )
        summary = train.run(cfg)
        c, runs = _runs(uri, "auth")
        assert [r.info.run_id for r in runs] == [summary["mlflow_run_id"]]
        assert "s3cret" not in str(runs[0].data.params) + str(runs[0].data.tags)
    finally:
        server.stop(proc)
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "s3cret-Passw0rd!"


def test_local_default_store_needs_no_server(tmp_path):
    cfg = load_config(
        None, [f"run.storage_path={tmp_path}", "scaling.num_workers=0", "training.epochs=1", "model.name=mlp"]
    )
    summary = train.run(cfg)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    c, runs = _runs(uri, "rayjobs")
    assert [r.info.run_id for r in runs] == [summary["mlflow_run_id"]]
    assert runs[0].info.artifact_uri.startswith((tmp_path / "mlartifacts").as_uri())
    assert {a.path for a in c.list_artifacts(runs[0].info.run_id)} >= {
        "config.yaml",
        "learning_curve.png",
        "checkpoints",
    }
    import mlflow.pytorch

    mlflow.set_tracking_uri(uri)
    model = mlflow.pytorch.load_model(runs[0].data.tags[MODEL_URI_TAG])
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


def test_a_crash_loses_no_metric_and_the_rerun_continues_the_same_run(tmp_path):
    from rayjobs.errors import TrainingFailed

    overrides = [
        f"run.storage_path={tmp_path}",
        "run.name=crash",
        "scaling.num_workers=0",
        "training.epochs=3",
        "training.batch_size=32",
        "checkpoint.every_steps=10",
        "tracking.log_every=5",
        "faults.raise_at_step=53",
    ]
    with pytest.raises(TrainingFailed):
        train.run(load_config(None, overrides))
    summary = train.run(load_config(None, overrides))
    c, runs = _runs(f"sqlite:///{tmp_path}/mlflow.db", "rayjobs")
    assert [r.info.run_id for r in runs] == [summary["mlflow_run_id"]]
    assert _steps(c, runs[0].info.run_id, "train/step_loss") == list(range(5, 117, 5))
    assert runs[0].data.tags[ATTEMPT_TAG] == "2"


def test_a_ray_that_fails_to_start_ends_the_mlflow_run_made_beside_it(tmp_path):
    """A local Ray starts while the run's MLflow run is made; when Ray's start fails (here its temp
    directory cannot be made), that MLflow run ends FAILED with the run's key, never left RUNNING,
    and the user gets one line naming the variable and the path."""
    proc = run_cli(
        "train", "--set", "training.epochs=1", cwd=tmp_path, env={"RAY_TMPDIR": "/proc/no-such-dir"}, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "rayjobs: error: RAY_TMPDIR=/proc/no-such-dir: No such file or directory; unset it or point it at a "
        "directory you can write to"
    ), proc.stderr[-3000:]
    c, runs = _runs(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}", "rayjobs")
    assert [(r.data.tags[RUN_KEY_TAG], r.info.status) for r in runs] == [
        (str(tmp_path / "results" / "digits-ddp"), "FAILED")
    ]
