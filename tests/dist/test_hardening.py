"""Hardening without Ray workers (local mode and the CLI): no secret in anything a run writes, no
duplicate model versions on a re-run, names that cannot break MLflow filters, checkpoints that
name code are not run, and bad input to every subcommand as one line with exit status 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import free_port, run_cli

from rayjobs import train
from rayjobs.config import load_config
from rayjobs.tracking import client, tracking_uri

LOCAL = ["scaling.num_workers=0", "model.name=mlp", "training.epochs=1", "training.batch_size=64"]


def test_no_secret_in_anything_a_run_writes(tmp_path, monkeypatch, capfd):
    password, token = "Pw-5f3a9c1e-not-for-files", "Tk-9b2d7e4f-not-for-files"
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "someone")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", token)
    cfg = load_config(None, [*LOCAL, f"run.storage_path={tmp_path}", f"tracking.tags.api_key={token}"])
    summary = train.run(cfg)
    train.write_summary(summary, str(tmp_path / "summary.json"))
    out = capfd.readouterr()
    assert password not in out.out + out.err and token not in out.out + out.err
    scanned = 0
    for f in tmp_path.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert password.encode() not in data and token.encode() not in data, f
            scanned += 1
    assert scanned > 10  # checkpoints, state.json, metrics, the MLflow store and its artifacts
    run = client(tracking_uri(cfg)).get_run(summary["mlflow_run_id"])
    assert run.data.tags["api_key"] == "***"


def test_a_run_without_a_test_split_trains_and_eval_names_the_empty_split(tmp_path):
    """``test_fraction=0``: no test metrics (every worker failed after training before), and eval of
    the empty split is one line naming the other splits."""
    from rayjobs.errors import ConfigError
    from rayjobs.evaluation import evaluate_checkpoint

    summary = train.run(load_config(None, [*LOCAL, f"run.storage_path={tmp_path}", "data.kwargs.test_fraction=0"]))
    metrics = summary["metrics"]
    assert metrics["val/accuracy"] > 0.5 and not [k for k in metrics if k.startswith("test/")], metrics
    empty = r"^eval: the test split of digits is empty \(data.kwargs.test_fraction=0\); pick --split val, train$"
    with pytest.raises(ConfigError, match=empty):
        evaluate_checkpoint(summary["checkpoint"])
    val = evaluate_checkpoint(summary["checkpoint"], "val")["metrics"]["val/accuracy"]
    assert val == pytest.approx(metrics["val/accuracy"], abs=1e-6)


def test_credentials_in_the_tracking_uri_are_refused():
    proc = run_cli("train", "--set", "tracking.uri=http://me:hunter2@mlflow:5000")
    assert proc.returncode == 2 and "hunter2" not in proc.stderr
    assert proc.stderr.startswith("rayjobs: error: tracking.uri: must not hold credentials")
    assert "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in proc.stderr


def test_a_rerun_of_a_finished_run_registers_no_second_version(tmp_path):
    import mlflow

    cfg_args = [*LOCAL, f"run.storage_path={tmp_path}", "tracking.register_as=twice"]
    first = train.run(load_config(None, cfg_args))
    second = train.run(load_config(None, cfg_args))  # finished: trains nothing, logs nothing again
    assert first["mlflow_run_id"] == second["mlflow_run_id"]
    mlflow.set_tracking_uri(tracking_uri(load_config(None, cfg_args)))
    versions = mlflow.MlflowClient().search_model_versions("name = 'twice'")
    assert len(versions) == 1, versions


def test_a_quote_in_the_run_name_keeps_one_mlflow_run(tmp_path, capfd):
    sets = [*LOCAL, f"run.storage_path={tmp_path}", "run.name=it's-mine"]
    first = train.run(load_config(None, sets))
    second = train.run(load_config(None, sets))
    assert first["mlflow_run_id"] and first["mlflow_run_id"] == second["mlflow_run_id"]
    assert "warning" not in capfd.readouterr().out.lower()


def test_export_runs_no_code_a_checkpoint_names(tmp_path):
    """A state.json edited to name `os:system` must not run it; a trusted callable is built when named."""
    summary = train.run(load_config(None, [*LOCAL, f"run.storage_path={tmp_path}", "tracking.enabled=false"]))
    evil = tmp_path / "evil"
    shutil.copytree(summary["checkpoint"], evil)
    state = json.loads((evil / "state.json").read_text())
    marker = tmp_path / "ran"
    state["config"]["model"] = {"name": "os:system", "flavor": "", "kwargs": {"command": f"touch {marker}"}}
    (evil / "state.json").write_text(json.dumps(state))
    from rayjobs.checkpoint import MANIFEST, sha256_file

    manifest = json.loads((evil / MANIFEST).read_text())
    manifest["files"]["state.json"] = sha256_file(evil / "state.json")  # whoever edits it rewrites the manifest too
    (evil / MANIFEST).write_text(json.dumps(manifest))
    proc = run_cli("export", str(evil), "--out", str(tmp_path / "w.pt"))
    assert proc.returncode == 2 and not marker.exists()
    assert proc.stderr.strip() == (
        f"rayjobs: error: export: checkpoint {evil} names the model 'os:system', a callable that rebuilding it "
        "would run; rayjobs runs no code a checkpoint names: if you trust it, pass --trust-model os:system"
    )

    mine = tmp_path / "mine"  # a user's own model, trusted by name
    user = train.run(
        load_config(
            None,
            [*LOCAL, f"run.storage_path={mine}", "model.name=user_model:build_tiny", "tracking.enabled=false"],
        )
    )
    proc = run_cli(
        "export", user["checkpoint"], "--out", str(tmp_path / "u.pt"), "--trust-model", "user_model:build_tiny"
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "u.pt").stat().st_size > 0


def test_manifest_names_stay_inside_the_checkpoint(tmp_path):
    from rayjobs.checkpoint import MANIFEST, verify

    ckpt_dir = tmp_path / "checkpoint_00000001"
    ckpt_dir.mkdir()
    (ckpt_dir / MANIFEST).write_text(json.dumps({"step": 1, "files": {"../../etc/passwd": "00"}}))
    assert verify(ckpt_dir) == "manifest names a file outside the checkpoint: '../../etc/passwd'"
    (ckpt_dir / MANIFEST).write_text(json.dumps([1, 2]))
    assert verify(ckpt_dir).startswith("unreadable manifest: TypeError")


def _bad(*args: str, needle: str, tmp_path: Path | None = None) -> None:
    proc = run_cli(*args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1 and needle in lines[0], lines
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_bad_input_to_data_prepare(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world " * 100)
    _bad(
        "data",
        "prepare",
        "text",
        str(corpus),
        "--out",
        str(tmp_path / "o"),
        "--seq-len",
        "-1",
        needle="--seq-len must be >= 1, got -1",
    )
    _bad(
        "data",
        "prepare",
        "digits",
        "--out",
        str(tmp_path / "o"),
        "--shards",
        "0",
        needle="--shards must be >= 1, got 0",
    )
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    _bad(
        "data",
        "prepare",
        "digits",
        "--out",
        str(foreign),
        needle="holds files that `rayjobs data prepare` did not write",
    )
    _bad("data", "prepare", "digits", "--out", "/proc/no-such-dir", needle="--out: cannot create /proc/no-such-dir")
    csvs = tmp_path / "csvs"
    csvs.mkdir()
    (csvs / "a.csv").write_text("x,label\n1,0\n2,1\n")
    (csvs / "b.csv").write_text("x,label\nfoo,0\nbar,1\n")
    _bad("data", "prepare", "csv", str(csvs), "--out", str(tmp_path / "c"), needle="do not share one schema")
    (tmp_path / "one.csv").write_text("x,label\n1,0\n2,1\n3,0\n")  # 3 rows: val would get none
    _bad(
        "data",
        "prepare",
        "csv",
        str(tmp_path / "one.csv"),
        "--out",
        str(tmp_path / "c"),
        needle="gives 3 row(s): too few to split 70/15/15 into train, val and test with one in each; give at least 4",
    )
    rows = "".join(f"{i},{i % 2}\n" for i in range(40))  # 28 training rows: less than the default batch of 64
    (tmp_path / "forty.csv").write_text("x,label\n" + rows)
    assert run_cli("data", "prepare", "csv", str(tmp_path / "forty.csv"), "--out", str(tmp_path / "f")).returncode == 0
    proc = run_cli(  # rows of one feature: an MLP (the default CNN is refused for them: test_models.py)
        "train", "--set", "data.name=parquet", "--set", f"data.kwargs.path={tmp_path / 'f'}", "--set", "model.name=mlp"
    )
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"rayjobs: error: training.batch_size: 64 rows a step, but {tmp_path / 'f'} holds 28 training row(s) for 2 "
        "worker(s), not one full batch; lower training.batch_size to at most 28, or give more data"
    ), proc.stderr[-2000:]
    assert "RAY_IMPORTED=False" in proc.stdout


@pytest.mark.slow
def test_prepare_into_its_own_folder_replaces_the_old_shards(tmp_path):
    out = tmp_path / "d"
    assert run_cli("data", "prepare", "digits", "--out", str(out), "--shards", "4").returncode == 0
    assert run_cli("data", "prepare", "digits", "--out", str(out), "--shards", "2").returncode == 0
    assert sorted(p.name for p in (out / "train").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]


@pytest.mark.slow
def test_bad_input_to_train_tune_checkpoints(tmp_path):
    _bad("train", "--set", "tune.name=../../x", needle="tune.name: must be a plain name without '/'")
    (tmp_path / "t.txt").write_text("abc " * 100)
    _bad(
        "train",
        "--set",
        "model.name=gpt",
        "--set",
        "data.name=text",
        "--set",
        f"data.kwargs={{path: {tmp_path}, val_path: {tmp_path}, seq_len: -1}}",
        needle="data.kwargs.seq_len: must be >= 1, got -1",
    )
    run = tmp_path / "r" / "checkpoint_00000005"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text("[1, 2]")
    (run / "state.json").write_text("[3]")
    proc = run_cli("checkpoints", str(tmp_path / "r"))
    assert proc.returncode == 0 and "INCOMPLETE" in proc.stdout and "unreadable manifest" in proc.stdout, proc.stderr
    _bad(
        "checkpoints",
        "r",
        "--storage-path",
        "s3://bucket/runs?endpoint_override=127.0.0.1:1&scheme=http",
        needle="s3://bucket/runs",
    )


def test_a_spool_that_cannot_be_written_warns_once_and_never_stops_training(tmp_path, capfd):
    from rayjobs.tracking import MetricsLogger

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the run directory should be")
    cfg = load_config(None, [f"run.storage_path={tmp_path}", "tracking.uri=http://127.0.0.1:9"])
    logger = MetricsLogger(cfg, "no-run", str(tmp_path / "k"), str(blocker / "spool.jsonl"))
    for step in range(1, 4):
        logger.log({"train/loss": 1.0 / step}, step)  # no exception reaches the training loop
    logger.close(timeout=5)
    warnings = [line for line in capfd.readouterr().out.splitlines() if "cannot write the MLflow spool" in line]
    assert len(warnings) == 1 and logger.dropped_points == 3


def test_a_failed_local_run_leaves_no_logger_thread_behind(tmp_path):
    import threading

    from rayjobs.errors import TrainingFailed

    def loggers() -> set:
        return {t for t in threading.enumerate() if t.name == "rayjobs-mlflow" and t.is_alive()}

    before = loggers()  # other tests' loggers in this process are not this test's business
    with pytest.raises(TrainingFailed, match="raise_at_step=5"):
        train.run(load_config(None, [*LOCAL, f"run.storage_path={tmp_path}", "faults.raise_at_step=5"]))
    assert not loggers() - before


def test_a_second_live_driver_of_the_same_run_is_refused(tmp_path):
    import subprocess
    import sys
    import time

    from conftest import subprocess_env

    from rayjobs.errors import ConfigError

    cfg_args = [*LOCAL, f"run.storage_path={tmp_path}", "run.name=shared", "tracking.enabled=false"]
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from rayjobs.lease import Lease; import time; Lease({str(tmp_path / 'shared')!r}).acquire(); "
            "print('held', flush=True); time.sleep(600)",
        ],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"another driver \(pid {holder.pid} on .*\) is running this run"):
            train.run(load_config(None, cfg_args))
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    summary = train.run(load_config(None, cfg_args))  # its driver is gone: the stale lease is taken over
    assert summary["metrics"]["step"] == 1257 // 64
    assert not (tmp_path / "shared" / ".lease").exists()  # released at the end


@pytest.mark.parametrize(
    "args, needle",
    [
        (["ui", "--port", "0"], "ui --port: must be a TCP port from 1 to 65535, got 0"),
        (["ui", "--port", "99999"], "ui --port: must be a TCP port from 1 to 65535, got 99999"),
        (["ui", "--storage-path", "/proc/no/such"], "ui --storage-path: cannot create /proc/no/such"),
        (["train", "--summary", "/proc/no/such/s.json"], "--summary: cannot create /proc/no"),
        (["eval", "/no/such", "--summary", "/proc/no/such/s.json"], "--summary: cannot create /proc/no"),
        (["cluster", "up", "--dashboard-port", "70000"], "cluster up --dashboard-port: must be a TCP port"),
        (["cluster", "up", "--config", "/no/such.yaml"], "cluster config: cannot read /no/such.yaml"),
        (["cluster", "down", "--port", "1"], "cluster down: no cluster that `rayjobs cluster up` started on port 1"),
        (["export", "/no/such", "--out", "w.pt"], "export: no checkpoint directory at /no/such"),
        (["checkpoints", "/no/such"], "checkpoints: '/no/such' is neither a run directory nor a run"),
        (["tune", "--set", "tune.space.optim.lr.uniform=[1]"], "tune.space.optim.lr: uniform needs [low, high]"),
        (["tune", "--set", "tune.name=a/b"], "tune.name: must be a plain name"),
        (["bench", "nosuch"], "bench: unknown benchmark(s) nosuch"),
        (["data", "prepare", "csv", "/no/such", "--out", "/tmp/rj-never"], "data prepare: no such file or directory"),
        (["doctor", "--set", "optim.lr=0"], "optim.lr: must be > 0, got 0"),
        (["screenshot", "--out", "x.png", "--storage-path", "/no/such"], "screenshot:"),
    ],
)
def test_every_subcommand_refuses_bad_values_in_one_line(args, needle):
    _bad(*args, needle=needle)


def test_cluster_up_on_a_port_in_use_is_one_line_before_ray_starts():
    """`ray start` on a dashboard port another Ray held started no dashboard and said nothing, and the
    `ray job submit --address` that `cluster up` printed sent jobs to that other Ray."""
    import glob
    import socket

    before = set(glob.glob("/tmp/rjc-*"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _bad("cluster", "up", "--port", str(port), needle=f"cluster up --port {port}: 127.0.0.1:{port} is in use")
        free = str(free_port())  # not the default 6379, which another test's cluster may hold
        _bad("cluster", "up", "--port", free, "--dashboard-port", str(port), needle=f"--dashboard-port {port}: 127.0")
    assert set(glob.glob("/tmp/rjc-*")) == before  # the temp dir it made for Ray is gone with it
