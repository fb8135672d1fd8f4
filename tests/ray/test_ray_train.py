"""The real driver on a real local Ray cluster (shared by this module): 2 DDP workers train digits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import checkpoint_weights, subprocess_env

from rayjobs import train
from rayjobs.config import CONFIG_DIR, load_config
from rayjobs.rundir import read_history

pytestmark = pytest.mark.ray


def test_two_workers_train_digits_and_the_loss_goes_down(ray_cluster, tmp_path):
    cfg = load_config(
        None,
        [
            f"run.storage_path={tmp_path}",
            "run.name=ray-digits",
            "scaling.num_workers=2",
            "training.epochs=4",
            "training.eval_every=10",
        ],
    )
    from ray.util.state import list_actors

    # This module's Ray by its address: without one Ray's state API picks a `ray start` cluster, and
    # fails where several run (other test modules' clusters beside this one).
    here = ray_cluster.get_runtime_context().gcs_address
    before = {a.actor_id for a in list_actors(address=here, limit=10_000)}
    summary = train.run(cfg)
    m = summary["metrics"]
    assert summary["num_workers"] == 2 and summary["device"] == "cpu"
    # Ray Train's helper actors that this run has no use for were not started (rayjobs.trainer): a
    # dataset manager (no Ray Dataset), a placement-group cleaner (this Ray ends with its driver) and
    # Ray Data's autoscaling coordinator (this Ray has no autoscaler).
    started = sorted(a.class_name for a in list_actors(address=here, limit=10_000) if a.actor_id not in before)
    assert started.count("RayTrainWorker") == 2 and "TrainController" in started, started
    assert "DatasetManager" not in started and "PlacementGroupCleaner" not in started, started
    assert "_AutoscalingCoordinatorActor" not in started, started
    assert m["step"] == 4 * (1257 // 64)
    assert m["test/accuracy"] >= 0.9, m
    assert m["train/loss"] < 0.5 and m["val/loss"] < 1.0

    # Every report reached the driver's history: the first report's loss is far above the last one.
    history = [h for h in read_history(summary["history"]) if "val/loss" in h]
    assert [h["step"] for h in history] == [10, 20, 30, 40, 50, 60, 70, 76]
    assert history[0]["train/loss"] > 2 * history[-1]["train/loss"], history
    # A worker's next report waits until the Train controller has taken the last one, which it does
    # when it polls: every 2 s at Ray's default, which made these 0.1 s-apart reports 2 s apart. The
    # quicker quarter of the gaps tells: the others hold evaluations and, on a loaded machine, slow steps.
    gaps = sorted(b["time"] - a["time"] for a, b in zip(history, history[1:]))
    assert gaps[len(gaps) // 4] < 1.0, gaps

    # The final checkpoint lives in the run's storage and loads without pickled code.
    assert summary["checkpoint"].startswith(str(tmp_path / "ray-digits"))
    weights = checkpoint_weights(summary["checkpoint"])
    assert weights["head.4.weight"].shape == (10, 128)

    train.write_summary(summary, str(tmp_path / "summary.json"))
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert {"run_name", "storage_path", "checkpoint", "mlflow_run_id", "wall_s", "samples_per_s", "metrics"} <= set(
        saved
    )
    assert saved["metrics"]["test/accuracy"] == m["test/accuracy"]

    # The launch timeline: every phase, none negative, adding up to the first step's time (within the run).
    launch = saved["launch"]
    phases = [
        f"launch/{p}_s"
        for p in ("driver", "ray", "mlflow", "datasets", "workers", "imports", "data", "model", "first_step")
    ]
    assert set(launch) == {*phases, "launch/first_step_after_s"}, launch
    assert all(launch[p] >= 0 for p in phases)
    assert abs(sum(launch[p] for p in phases) - launch["launch/first_step_after_s"]) < 0.01
    assert launch["launch/ray_s"] < 1.0  # this module's Ray is already up: nothing to start
    assert launch["launch/workers_s"] + launch["launch/imports_s"] > 1.0  # new worker processes under Ray
    assert 0 < launch["launch/first_step_after_s"] < saved["wall_s"] + 5
    import mlflow

    logged = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(summary["mlflow_run_id"]).data.metrics
    assert logged["launch/first_step_after_s"] == pytest.approx(launch["launch/first_step_after_s"], abs=1e-3)


@pytest.mark.parametrize(
    ("config", "workers", "layout"),
    [("gpt-fsdp.yaml", 2, "fsdp: dp_shard=2"), ("gpt-fsdp-tp.yaml", 4, "fsdp+tp: dp_shard=2 x tp=2")],
)
def test_shipped_parallel_configs_train_on_cpu_workers(ray_cluster, tmp_path, capfd, config, workers, layout):
    """What `rayjobs train --config rayjobs/configs/<config>` runs, on CPU workers: the loss goes down."""
    cfg = load_config(
        CONFIG_DIR / config,
        [
            f"run.storage_path={tmp_path}",
            "model.flavor=debug",
            "scaling.use_gpu=false",
            f"scaling.num_workers={workers}",
            f"scaling.resources_per_worker={{CPU: {2 / workers}}}",
            "training.max_steps=40",
            "training.eval_every=10",
            "optim.lr=0.01",  # the debug model learns the token pattern in 40 steps at this rate
            "tracking.enabled=false",
        ],
    )
    summary = train.run(cfg)
    history = [h for h in read_history(summary["history"]) if "val/loss" in h]
    assert [h["step"] for h in history] == [10, 20, 30, 40]
    assert history[-1]["train/loss"] < 0.8 * history[0]["train/loss"], history
    assert history[-1]["val/loss"] < history[0]["val/loss"]
    out = capfd.readouterr().out
    assert f"memory estimate per rank ({layout})" in out
    assert f"({layout})" in out.split("parameters;", 1)[1]  # the workers' own line names the layout
    weights = checkpoint_weights(summary["checkpoint"])  # the sharded checkpoint loads in one process
    assert weights["layers.0.attn.q_proj.weight"].shape == (32, 32)


def test_a_users_data_and_task_train_under_fsdp_on_two_workers(ray_cluster, tmp_path):
    """A user's module (tests/user_model.py: map-style datasets and a Huber task with its own metric)
    on 2 Ray workers under FSDP2: the metric is the task's, exact over the ranks, and in MLflow.
    (The README trains the same task under DDP on 2 workers, and searches it with rayjobs tune.)"""
    import mlflow

    cfg = load_config(
        None,
        [
            f"run.storage_path={tmp_path}",
            "model.name=mlp",
            "model.kwargs={hidden: 64, depth: 2}",
            "data.name=user_model:sine_data",
            "task.name=user_model:huber_task",
            "parallel.strategy=fsdp",
            "scaling.num_workers=2",
            "training.epochs=20",
            "training.batch_size=32",
            "training.eval_every=110",
            "checkpoint.every_epochs=0",
            "checkpoint.keep_best=1",
            "checkpoint.metric=val/within_half",
            "checkpoint.mode=max",
        ],
    )
    assert cfg.run.name == "mlp-sine_data" and (cfg.tune.metric, cfg.tune.mode) == ("val/within_half", "max")
    summary = train.run(cfg)
    m = summary["metrics"]
    assert m["step"] == 20 * (358 // 32)
    history = [h for h in read_history(summary["history"]) if "val/within_half" in h]
    assert [h["step"] for h in history] == [110, 220]
    assert m["test/within_half"] > 0.6 and m["val/mae"] < 0.4, m  # predicting 0: 0.32 within 0.5, mae 0.65
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    logged = mlflow.get_run(summary["mlflow_run_id"]).data.metrics
    assert logged["test/within_half"] == pytest.approx(m["test/within_half"])


def test_workers_that_a_local_ray_cannot_hold_are_one_error_not_a_wait(ray_cluster):
    """A local Ray knows all it has once started: memory beyond it was a run waiting for ever."""
    from rayjobs.errors import ConfigError
    from rayjobs.launch import check_local_resources
    from rayjobs.plan import ScalingPlan

    have = ray_cluster.cluster_resources()["memory"]
    check_local_resources(ScalingPlan(2, False, {"CPU": 1.0, "memory": have / 2}))
    with pytest.raises(ConfigError, match=r"^scaling.resources_per_worker.memory: 2 worker\(s\) need .* GiB in all, "):
        check_local_resources(ScalingPlan(2, False, {"CPU": 1.0, "memory": have}))
    check_local_resources(ScalingPlan(8, False, {"CPU": 1.0}))  # CPUs: a local Ray is started with enough


def test_our_local_ray_starts_no_worker_ahead_of_need_and_knows_it_is_ours(ray_cluster):
    """Ray prestarts a worker per CPU for the first driver; they have no runtime_env and a rayjobs
    job has one, so none was ever used, and they slowed the start of a small machine's Ray."""
    import os

    import psutil

    from rayjobs.launch import PRESTART_VARIABLE, owns_local_ray

    raylets = [p for p in psutil.Process().children(recursive=True) if p.name() == "raylet"]
    assert raylets and all(p.environ().get(PRESTART_VARIABLE) == "0" for p in raylets)
    assert PRESTART_VARIABLE not in os.environ  # the driver's own environment is left as it was
    assert owns_local_ray()


def test_every_process_of_our_local_ray_knows_its_cluster_beside_another_ray(ray_cluster):
    """Ray Train's placement-group cleaner asks Ray's state API about its controller; without
    RAY_ADDRESS that API picks the newest `ray start` cluster on the machine, or fails when several
    Rays run, and an early-stopped trial's workers stayed reserved (CI saw it)."""
    import ray

    @ray.remote(num_cpus=0)
    class Controller:
        def ping(self) -> int:
            return 1

    @ray.remote(num_cpus=0)
    def what_the_state_api_sees(actor_id: str) -> tuple[str, bool]:
        from ray._private.services import canonicalize_bootstrap_address_or_die
        from ray.train.v2._internal.state.util import is_actor_alive

        return canonicalize_bootstrap_address_or_die(None), is_actor_alive(actor_id, timeout=30)

    ours = ray.get_runtime_context().gcs_address
    other = subprocess.Popen(  # a second Ray on this machine, started by our own launcher
        [sys.executable, "-c", START_AND_WAIT], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    try:
        assert other.stdout.readline().strip().startswith("started"), "the second Ray did not start"
        controller = Controller.remote()
        ray.get(controller.ping.remote())
        address, alive = ray.get(what_the_state_api_sees.remote(controller._actor_id.hex()))
        assert address == ours and alive, (address, ours)
    finally:
        other.kill()
        other.wait(timeout=30)


START_AND_WAIT = (
    "import sys, time\n"
    "from rayjobs.launch import start_local_ray\n"
    "start_local_ray(num_cpus=1, include_dashboard=False)\n"
    "print('started', flush=True)\n"
    "time.sleep(600)\n"
)


def test_ctrl_c_ends_the_run_killed_and_says_where_it_resumes(tmp_path):
    """Ctrl-C in `rayjobs train`: Ray Train aborts the workers, then its ray.get raised SystemExit(1) out
    of fit(): exit 1 and not a word. Now: exit 130, the newest checkpoint named, the MLflow run KILLED."""
    import signal
    import time

    from conftest import VENV_BIN

    cmd = [f"{VENV_BIN}/rayjobs", "train", "--set", "run.name=intr", "--set", "checkpoint.every_steps=10"]
    cmd += ["--set", "training.epochs=400"]  # far longer than the test waits (7,600 steps, minutes)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    run_dir = tmp_path / "results" / "intr"
    deadline = time.monotonic() + 180  # any checkpoint: the first ones are pruned (keep_last) within a second
    while not any(run_dir.glob("checkpoint_*/manifest.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before the test could interrupt it"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 130, (proc.returncode, err.decode()[-3000:])
    assert lines[-1].startswith(f"rayjobs: interrupted; newest checkpoint {tmp_path}/results/intr/checkpoint_0000")
    assert lines[-1].endswith(": the same command resumes from it"), lines[-1]
    assert "Traceback" not in err.decode()
    # A local Ray's one node is never drained: no preemption watcher, nor Ray's error line about it.
    assert "PreemptionWatcher" not in out.decode() + err.decode()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["KILLED"]
