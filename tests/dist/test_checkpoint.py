"""Checkpoints in one process (local mode): exact resume, integrity, storage errors, export, listing.

The Ray variants (a worker killed hard, 2 workers -> 1, NaN on one rank) are in test_ray_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, checkpoint_weights, run_cli, subprocess_env

from rayjobs import checkpoint as ckpt
from rayjobs import train
from rayjobs.config import load_config
from rayjobs.errors import TrainingFailed
from rayjobs.rundir import read_history

BASE = [
    "scaling.num_workers=0",
    "training.epochs=3",
    "training.batch_size=32",
    "training.eval_every=15",
    "checkpoint.every_steps=10",
    "checkpoint.keep_last=3",
]
STEPS = 3 * (1257 // 32)  # 117


def cfg_for(tmp_path: Path, name: str, *extra: str):
    return load_config(None, [*BASE, f"run.storage_path={tmp_path}", f"run.name={name}", *extra])


weights = checkpoint_weights


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same config, never interrupted."""
    root = tmp_path_factory.mktemp("ref")
    summary = train.run(cfg_for(root, "ref"))
    return summary


def test_final_checkpoint_is_named_in_the_summary(uninterrupted):
    path = uninterrupted["checkpoint"]
    assert Path(path).name == ckpt.name_for(STEPS)
    assert ckpt.verify(path) == ""
    state = json.loads((Path(path) / "state.json").read_text())
    assert state["step"] == STEPS and state["world_size"] == 1
    assert state["config"]["model"]["name"] == "digits_cnn"
    kept = [c.step for c in ckpt.list_checkpoints(Path(path).parent)]
    assert kept == [100, 110, STEPS]  # keep_last=3


def test_rerun_after_a_crash_resumes_bit_identical(tmp_path, uninterrupted):
    """Crash mid-epoch (step 53 of 117, epoch 2), re-run the same run.name: the same parameters, bit for bit."""
    with pytest.raises(TrainingFailed, match="raise_at_step=53"):
        train.run(cfg_for(tmp_path, "crashy", "faults.raise_at_step=53"))
    assert ckpt.latest_complete(tmp_path / "crashy").step == 50
    summary = train.run(cfg_for(tmp_path, "crashy", "faults.raise_at_step=53"))
    resumed, reference = weights(summary["checkpoint"]), weights(uninterrupted["checkpoint"])
    assert resumed.keys() == reference.keys()
    for key in reference:
        assert torch.equal(resumed[key], reference[key]), key
    # The reports after the resume point match the uninterrupted run's exactly.
    ref_hist = {h["step"]: h for h in read_history(uninterrupted["history"])}
    new_hist = {h["step"]: h for h in read_history(summary["history"])}
    for step in (60, 75, 90, 105):
        assert new_hist[step]["train/loss"] == ref_hist[step]["train/loss"], step
        assert new_hist[step]["val/loss"] == ref_hist[step]["val/loss"], step
    assert summary["metrics"]["test/accuracy"] == uninterrupted["metrics"]["test/accuracy"]


@pytest.mark.slow  # three CLI runs (21 s): in `make test`'s second part, so that test-fast stays under 3 minutes
def test_rerunning_a_finished_run_trains_nothing_and_claims_no_throughput(tmp_path):
    """The same command again resumes at the final step: no step, so no train loss and no samples/s
    (it printed 18240000000000 samples/s: the checkpoint's samples over this attempt's zero time)."""
    command = ["train", "--set", "scaling.num_workers=0", "--set", "training.max_steps=12"]
    first = run_cli(*command, cwd=tmp_path, timeout=120)
    assert first.returncode == 0, first.stderr
    assert re.search(r"throughput: [1-9][0-9]* samples/s", first.stdout), first.stdout
    again = run_cli(*command, "--summary", "again.json", cwd=tmp_path, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "throughput: no step trained: the run had already finished (a new run.name trains afresh)" in again.stdout, again.stdout
    summary = json.loads((tmp_path / "again.json").read_text())
    assert summary["samples_per_s"] == 0 and summary["metrics"]["step"] == 12
    assert "train/loss" not in summary["metrics"] and summary["metrics"]["perf/mfu"] == 0
    assert "with a changed config" not in again.stdout, again.stdout
    # The same name with another learning rate: it continues that run, and says so (it said nothing).
    changed = run_cli(*command, "--set", "optim.lr=1e-2", cwd=tmp_path, timeout=120)
    assert changed.returncode == 0, changed.stderr
    assert (
        "rayjobs: run digits-ddp continues from checkpoint_00000012 with a changed config: optim.lr 0.003 -> 0.01; "
        "a new run.name starts a new run"
    ) in changed.stdout, changed.stdout


def test_each_async_save_holds_its_own_steps_weights_though_the_staging_copy_is_reused(tmp_path):
    """One Saver stages every async save into the same memory; a save must still hold the weights of
    its step even when the next step changes them in place while it is being written."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from models import DataInfo, build_model
    from rayjobs.context import WorkerContext
    from rayjobs.stepping import build_optimizer, build_scheduler

    ctx = WorkerContext(0, 1, 0, torch.device("cpu"))
    model = build_model("gpt", "debug", {}, DataInfo("tokens", (16,), 64))
    cfg = load_config(None, ["optim.name=adamw"])
    opt = build_optimizer(model, cfg)
    saver = ckpt.Saver(str(tmp_path), ctx, {}, keep_last=3, async_save=True)
    expected = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        expected[step] = {k: v.clone() for k, v in get_model_state_dict(model).items()}
        assert saver.save(step, model, opt, build_scheduler(opt, cfg, 10), None, ckpt.TrainState(step=step)) is None
        with torch.no_grad():  # the next step, while the save is still being written
            for p in model.parameters():
                p.fill_(-1.0)
    saver.close()
    staged = [c.path for c in ckpt.list_checkpoints(tmp_path)]
    assert len(staged) == 3
    for step, path in zip((1, 2, 3), staged):
        ckpt.load_weights(path, model, ctx)
        got = get_model_state_dict(model)
        assert set(got) == set(expected[step])
        assert all(torch.equal(got[k], expected[step][k]) for k in got), f"step {step}'s checkpoint is not its own"


def test_a_run_directory_holding_another_models_checkpoint_is_refused_before_ray_starts(uninterrupted, tmp_path):
    """The same run.name with another model: one line, before Ray (or any training) starts."""
    import shutil

    theirs = Path(uninterrupted["checkpoint"])
    run_dir = tmp_path / "results" / "mine"
    shutil.copytree(theirs, run_dir / theirs.name)
    proc = run_cli("train", "--set", "run.name=mine", "--set", "model.name=mlp", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        f"rayjobs: error: {run_dir / theirs.name} holds a checkpoint of the model digits_cnn/default, but this run's "
        "model is mlp/default; give this run its own run.name (--set run.name=...), or resume a checkpoint of the same job"
    )
    assert proc.stdout.strip().endswith("RAY_IMPORTED=False")
    assert sorted(p.name for p in run_dir.iterdir()) == [theirs.name]  # nothing written beside it
    # Another optimizer: its state cannot be loaded (it failed in every worker, with their tracebacks).
    proc = run_cli("train", "--set", "run.name=mine", "--set", "optim.name=sgd", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"rayjobs: error: {run_dir / theirs.name} was trained with optim.name=adamw, this run uses optim.name=sgd "
        "(its state cannot carry over); give this run its own run.name (--set run.name=...), or resume a checkpoint "
        "of the same job"
    ), proc.stderr[-2000:]
    assert sorted(p.name for p in run_dir.iterdir()) == [theirs.name]


def test_async_checkpoints_resume_bit_identical_too(tmp_path, uninterrupted):
    with pytest.raises(TrainingFailed):
        train.run(cfg_for(tmp_path, "async", "checkpoint.async=true", "faults.raise_at_step=53"))
    assert ckpt.latest_complete(tmp_path / "async").step == 50
    summary = train.run(cfg_for(tmp_path, "async", "checkpoint.async=true", "faults.raise_at_step=53"))
    for key, value in weights(uninterrupted["checkpoint"]).items():
        assert torch.equal(weights(summary["checkpoint"])[key], value), key
    assert summary["metrics"]["checkpoint/blocked_s"] > 0


def test_a_finished_run_rerun_does_not_train_again(tmp_path):
    first = train.run(cfg_for(tmp_path, "done", "training.epochs=1"))
    again = train.run(cfg_for(tmp_path, "done", "training.epochs=1"))
    assert again["checkpoint"] == first["checkpoint"]
    assert again["metrics"]["test/accuracy"] == first["metrics"]["test/accuracy"]


def test_a_corrupt_latest_checkpoint_is_skipped_with_a_warning(tmp_path, capfd):
    with pytest.raises(TrainingFailed):
        train.run(cfg_for(tmp_path, "corrupt", "faults.raise_at_step=35"))
    summary = train.run(
        cfg_for(tmp_path, "corrupt", "faults.raise_at_step=35", "faults.corrupt_latest_checkpoint=true")
    )
    out = capfd.readouterr().out
    bad = tmp_path / "corrupt" / ckpt.name_for(30)
    assert f"warning: skipping checkpoint {bad}: sha256 mismatch" in out
    assert f"resumed from {tmp_path / 'corrupt' / ckpt.name_for(20)} at step 20" in out
    assert summary["metrics"]["step"] == STEPS


def test_no_manifest_means_incomplete(tmp_path):
    with pytest.raises(TrainingFailed):
        train.run(cfg_for(tmp_path, "partial", "faults.raise_at_step=25"))
    latest = tmp_path / "partial" / ckpt.name_for(20)
    (latest / ckpt.MANIFEST).unlink()
    assert ckpt.verify(latest) == "no manifest (the save did not finish)"
    assert ckpt.latest_complete(tmp_path / "partial").step == 10


def test_resume_from_an_explicit_checkpoint_and_a_bad_one(tmp_path, uninterrupted):
    source = str(Path(uninterrupted["checkpoint"]).parent / ckpt.name_for(100))
    summary = train.run(cfg_for(tmp_path, "forked", f"checkpoint.resume_from={source}"))
    assert summary["metrics"]["step"] == STEPS
    for key, value in weights(uninterrupted["checkpoint"]).items():
        assert torch.equal(weights(summary["checkpoint"])[key], value)
    from rayjobs.errors import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.resume_from: no checkpoint directory at"):
        train.run(cfg_for(tmp_path, "x", f"checkpoint.resume_from={tmp_path}/nope"))
    with pytest.raises(
        ConfigError, match="checkpoint.resume_from: .* holds a checkpoint of the model digits_cnn/default, "
    ):
        train.run(cfg_for(tmp_path, "other-model", f"checkpoint.resume_from={source}", "model.name=mlp"))
    assert not (tmp_path / "other-model").exists() or not list((tmp_path / "other-model").glob("checkpoint_*"))


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # MLflow's thread warns, lives
def test_read_only_storage_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path):
    """Real read-only storage: the run directory made immutable (chattr +i) after the first checkpoint."""
    if subprocess.run(["which", "chattr"], capture_output=True).returncode != 0:
        pytest.skip("chattr is not available")
    run_dir = tmp_path / "ro"
    first = run_dir / ckpt.name_for(20)
    stop = threading.Event()

    def freeze() -> None:
        while not stop.is_set():
            if (first / ckpt.MANIFEST).exists():
                subprocess.run(["chattr", "+i", str(run_dir)], check=True)
                return
            time.sleep(0.002)

    watcher = threading.Thread(target=freeze)
    watcher.start()
    try:
        with pytest.raises(TrainingFailed) as info:
            train.run(
                cfg_for(
                    tmp_path, "ro", "checkpoint.every_steps=20", "checkpoint.every_epochs=0", "model.kwargs.width=64"
                )
            )
    finally:
        stop.set()
        watcher.join()
        subprocess.run(["chattr", "-i", str(run_dir)], check=False)
    message = str(info.value)
    assert f"not saved to {run_dir / ckpt.name_for(40)}" in message
    assert "Operation not permitted" in message or "Permission" in message
    assert f"the previous checkpoint {first} is intact" in message
    assert ckpt.verify(first) == ""
    assert weights(str(first))  # it loads


def test_nan_skip_policy_skips_the_step_and_finishes(tmp_path, capfd):
    summary = train.run(cfg_for(tmp_path, "nanskip", "faults.nan_at_step=12", "training.nan_policy=skip"))
    assert summary["metrics"]["step"] == STEPS and summary["metrics"]["test/accuracy"] > 0.9
    assert "step 12: non-finite loss on rank(s) [0]; step skipped" in capfd.readouterr().out


def test_nan_stop_policy_fails_naming_the_step(tmp_path):
    with pytest.raises(
        TrainingFailed, match=r"non-finite loss at step 12 on rank\(s\) 0; every rank stopped without saving it"
    ):
        train.run(cfg_for(tmp_path, "nanstop", "faults.nan_at_step=12"))
    assert ckpt.latest_complete(tmp_path / "nanstop").step == 10  # the NaN state was never saved


@pytest.mark.slow
def test_cli_lists_and_exports(tmp_path, uninterrupted):
    run_dir = str(Path(uninterrupted["checkpoint"]).parent)
    proc = subprocess.run(
        [sys.executable, "-m", "rayjobs", "checkpoints", run_dir],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == ["100", "110", str(STEPS)] and all(r[1] == "complete" for r in rows)
    for suffix in (".pt", ".safetensors"):
        out = tmp_path / f"weights{suffix}"
        proc = subprocess.run(
            [sys.executable, "-m", "rayjobs", "export", uninterrupted["checkpoint"], "--out", str(out)],
            cwd=REPO,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        if suffix == ".pt":
            loaded = torch.load(out, weights_only=True)
        else:
            from safetensors.torch import load_file

            loaded = load_file(str(out))
        assert "head.4.weight" in loaded and loaded["head.4.weight"].shape == (10, 128)
    bad = subprocess.run(
        [sys.executable, "-m", "rayjobs", "export", str(tmp_path), "--out", str(tmp_path / "w.pt")],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "no manifest" in bad.stderr and "Traceback" not in bad.stderr

    def refused_export(out: str) -> str:
        """The one line `rayjobs export --out OUT` ends with when it cannot write there."""
        cmd = [sys.executable, "-m", "rayjobs", "export", uninterrupted["checkpoint"], "--out", out]
        bad = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        return bad.stderr.strip().splitlines()[-1]

    for unwritable in ("/proc/rayjobs-export.pt", "/proc/rayjobs-export.safetensors"):  # not writable, even by root
        assert refused_export(unwritable) == (
            "rayjobs: error: export: --out: /proc is not writable (No such file or directory); "
            "give a directory you can write to"
        )
    long_name = tmp_path / ("w" * 300 + ".pt")  # the directory is writable, the file cannot be made
    assert refused_export(str(long_name)) == (
        f"rayjobs: error: export: cannot write {long_name}: File name too long; "
        "give a path in a directory you can write to"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.pt", "weights.safetensors"]  # nothing partial
    # Both as the user's umask makes files (safetensors made its file readable by its owner only).
    modes = {p.suffix: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes[".safetensors"] == modes[".pt"] == 0o666 & ~_umask(), modes


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_sigterm_takes_a_checkpoint_then_exits(tmp_path):
    """Preemption in local mode: SIGTERM -> a checkpoint at the next step -> the process ends by SIGTERM."""
    import signal

    cmd = [
        sys.executable,
        "-m",
        "rayjobs.train",
        "--set",
        "scaling.num_workers=0",
        "--set",
        "training.epochs=40",
        "--set",
        "checkpoint.every_steps=1000",
        "--set",
        "checkpoint.every_epochs=0",
        "--set",
        "tracking.enabled=false",
        "--set",
        f"run.storage_path={tmp_path}",
        "--set",
        "run.name=preempted",
        "--set",
        "training.log_every=5",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for line in proc.stdout:  # wait until it is training
        if "[rayjobs] step " in line:
            break
    proc.send_signal(signal.SIGTERM)
    out = proc.stdout.read()
    assert proc.wait(timeout=60) == -signal.SIGTERM, out[-2000:]
    assert "preemption notice: taking a checkpoint now" in out
    latest = ckpt.latest_complete(tmp_path / "preempted", warn=False)
    assert latest is not None and 0 < latest.step < 40 * (1257 // 64)


def _ray_checkpoint_manager(storage: Path, name: str):
    """Ray Train's own checkpoint manager for one run directory (what its controller builds first)."""
    from ray.train import CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext

    return CheckpointManager(CheckpointConfig(), StorageContext(storage_path=str(storage), experiment_dir_name=name))


def test_pruned_checkpoints_do_not_stop_a_rerun_with_the_same_name(tmp_path):
    """Ray's snapshot names every reported checkpoint; after our keep_last pruned one, a re-run must still start."""
    import asyncio

    import ray.train
    from ray.train.v2._internal.exceptions import CheckpointManagerInitializationError
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    run_dir = tmp_path / "run"

    async def report_three() -> None:
        manager = _ray_checkpoint_manager(tmp_path, "run")
        for step in (10, 20, 30):
            path = run_dir / ckpt.name_for(step)
            path.mkdir(parents=True)
            manager.register_checkpoint(_TrainingReport(ray.train.Checkpoint(str(path)), {"step": step}, False))

    asyncio.run(report_three())
    import shutil

    shutil.rmtree(run_dir / ckpt.name_for(10))  # what Saver._prune does with keep_last=2
    with pytest.raises(CheckpointManagerInitializationError):
        _ray_checkpoint_manager(tmp_path, "run")
    assert ckpt.reconcile_ray_snapshot(run_dir) == [ckpt.name_for(10)]
    manager = _ray_checkpoint_manager(tmp_path, "run")
    assert manager.latest_checkpoint_result.checkpoint.path.endswith(ckpt.name_for(30))
    assert ckpt.reconcile_ray_snapshot(run_dir) == []  # nothing more to drop

    shutil.rmtree(run_dir / ckpt.name_for(30))  # even the latest gone: the newest left becomes latest
    assert ckpt.reconcile_ray_snapshot(run_dir) == [ckpt.name_for(30)]
    assert _ray_checkpoint_manager(tmp_path, "run").latest_checkpoint_result.checkpoint.path.endswith(ckpt.name_for(20))

    (run_dir / ckpt.RAY_SNAPSHOT).write_text('{"ray_version": "2.60.0", "checkpoint_res')  # cut by a kill
    assert ckpt.reconcile_ray_snapshot(run_dir) == ["*"]
    assert _ray_checkpoint_manager(tmp_path, "run").latest_checkpoint_result is None


def test_resume_from_is_for_the_first_start_only(tmp_path, uninterrupted, capfd):
    """A run started from another run's checkpoint that crashes resumes from its own newest one, not
    from the source again; the source is never pruned; checkpoints of another lineage are refused."""
    source = str(Path(uninterrupted["checkpoint"]).parent / ckpt.name_for(100))
    sets = [f"checkpoint.resume_from={source}", "training.epochs=4", "checkpoint.keep_last=1"]
    with pytest.raises(TrainingFailed, match="raise_at_step=135"):
        train.run(cfg_for(tmp_path, "b", *sets, "faults.raise_at_step=135"))
    capfd.readouterr()
    summary = train.run(cfg_for(tmp_path, "b", *sets, "faults.raise_at_step=135"))
    out = capfd.readouterr().out
    assert f"resumed from {tmp_path / 'b' / ckpt.name_for(130)} at step 130" in out, out[-2000:]
    assert summary["metrics"]["step"] == 4 * (1257 // 32)
    assert ckpt.verify(source) == ""  # keep_last=1 in b never touches a's

    # The source inside the run's own directory: resumed from, and kept although keep_last=1.
    first = train.run(cfg_for(tmp_path, "c", "training.max_steps=20", "checkpoint.keep_last=1"))
    own = first["checkpoint"]
    train.run(
        cfg_for(tmp_path, "c", f"checkpoint.resume_from={own}", "training.max_steps=40", "checkpoint.keep_last=1")
    )
    assert ckpt.verify(own) == "" and [c.step for c in ckpt.list_checkpoints(tmp_path / "c")] == [20, 40]

    # A directory holding checkpoints of another lineage: one line, naming the fix.
    with pytest.raises(
        TrainingFailed,
        match=r"already holds checkpoints of another run \(newest: step 40\); give this run a new run.name",
    ):
        train.run(cfg_for(tmp_path, "c", f"checkpoint.resume_from={source}"))


def test_a_commit_flushes_every_file_before_the_manifest_and_prunes_after(tmp_path, monkeypatch):
    """The order of a commit, recorded from the real calls: fsync of every file, the manifest's
    rename, fsync of the directories, and only then the pruning of older checkpoints."""
    import os
    import shutil

    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_rmtree, real_open = os.fsync, os.replace, shutil.rmtree, os.open
    opened: dict[int, str] = {}

    def spy_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        opened[fd] = str(path)
        return fd

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", opened.get(fd, "?"))), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(b))), real_replace(a, b))[1])
    monkeypatch.setattr(shutil, "rmtree", lambda p, **kw: (events.append(("prune", str(p))), real_rmtree(p, **kw))[1])
    train.run(cfg_for(tmp_path, "order", "training.max_steps=20", "checkpoint.keep_last=1", "tracking.enabled=false"))
    second = str(tmp_path / "order" / ckpt.name_for(20))
    mine = [e for e in events if e[1].startswith(second) or e[0] == "prune" or e[1] == str(tmp_path / "order")]
    names = [(kind, Path(p).name) for kind, p in mine]
    rename = names.index(("rename", "manifest.json"))
    files = {Path(p).name for kind, p in mine[:rename] if kind == "fsync"}
    assert {"state.json", "rank_0.pt", ".metadata", ".manifest.json.tmp"} <= files, names
    after = names[rename + 1 :]
    assert after[:2] == [("fsync", ckpt.name_for(20)), ("fsync", "order")], after
    assert ("prune", ckpt.name_for(10)) in after[2:], after


def test_eval_of_the_final_checkpoint_gives_the_runs_test_metrics(uninterrupted, tmp_path):
    """`rayjobs eval CHECKPOINT`: the run's own test metrics (local mode: the same sums, so equal);
    other data of another shape, a wrong split and a missing checkpoint are one line each."""
    out = tmp_path / "eval.json"
    proc = run_cli("eval", uninterrupted["checkpoint"], "--summary", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["step"] == STEPS and got["task"] == "classification" and got["rows"] == 270
    m = uninterrupted["metrics"]
    assert got["metrics"] == {"test/loss": m["test/loss"], "test/accuracy": m["test/accuracy"]}
    assert f"test/accuracy {m['test/accuracy']:.4f}" in proc.stdout
    bad = run_cli(
        "eval", uninterrupted["checkpoint"], "--set", "data.name=synthetic", "--set", "data.kwargs.shape=[1, 4, 4]"
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"rayjobs: error: eval: checkpoint {uninterrupted['checkpoint']} was trained on inputs (1, 8, 8) with 10 "
        "output(s) (class targets), but data.name=synthetic gives inputs (1, 4, 4) with 10 (class targets); "
        "evaluate it on data of the same shape"
    ]
    for args, line in [
        (["--split", "dev"], "eval: --split must be one of test, val, train, got 'dev'"),
        (
            ["--set", "optim.lr=1"],
            "eval: --set optim.lr=1: only data.*, task.*, training.batch_size and precision apply",
        ),
    ]:
        proc = run_cli("eval", uninterrupted["checkpoint"], *args)
        assert proc.returncode == 2 and proc.stderr.strip() == f"rayjobs: error: {line}", proc.stderr
        assert "TORCH_IMPORTED=False" in proc.stdout  # checked before torch: it took 2 s to say
    # A run's name alone is looked up under ./results, as `rayjobs checkpoints RUN` does; a mistyped one
    # names the runs there.
    run_dir = os.path.dirname(uninterrupted["checkpoint"])
    (tmp_path / "here").mkdir()
    os.symlink(os.path.dirname(run_dir), tmp_path / "here" / "results")
    proc = run_cli("eval", "nope", cwd=tmp_path / "here")
    assert proc.stderr.strip() == "rayjobs: error: eval: no checkpoint directory at nope; runs in results/: ref"
    proc = run_cli("eval", os.path.basename(run_dir), "--split", "val", cwd=tmp_path / "here")  # another split
    assert f"val/accuracy {m['val/accuracy']:.4f}" in proc.stdout, proc.stdout + proc.stderr
    proc = run_cli("eval", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"rayjobs: error: eval: {tmp_path} is neither a checkpoint (no manifest.json) nor a run directory "
        "(no checkpoint_* in it); give a checkpoint directory: `rayjobs checkpoints RUN` lists a run's"
    )
    proc = run_cli("eval", run_dir)  # a run directory: its newest complete checkpoint
    assert proc.returncode == 0 and f"test/accuracy {m['test/accuracy']:.4f}" in proc.stdout, proc.stderr[-2000:]
    assert f"using its newest complete checkpoint, {uninterrupted['checkpoint']}" in proc.stdout, proc.stdout


def test_eval_and_export_take_the_mlflow_run_of_a_checkpoint(uninterrupted, tmp_path):
    """`rayjobs eval runs:/RUN_ID`: the checkpoint the run logged its model from; the store is named by
    --tracking-uri (or $MLFLOW_TRACKING_URI, or ./results/mlflow.db); what is not there is one line."""
    store = f"sqlite:///{Path(uninterrupted['storage_path']).parent / 'mlflow.db'}"
    source = f"runs:/{uninterrupted['mlflow_run_id']}"
    proc = run_cli("eval", source, "--tracking-uri", store, "--summary", str(tmp_path / "eval.json"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads((tmp_path / "eval.json").read_text())
    assert got["checkpoint"] == str(Path(uninterrupted["checkpoint"]).resolve())
    assert got["metrics"]["test/accuracy"] == uninterrupted["metrics"]["test/accuracy"]
    os.makedirs(tmp_path / "results")
    os.symlink(Path(uninterrupted["storage_path"]).parent / "mlflow.db", tmp_path / "results" / "mlflow.db")
    export = run_cli("export", source, "--out", str(tmp_path / "w.pt"), cwd=tmp_path)  # ./results/mlflow.db
    assert export.returncode == 0 and (tmp_path / "w.pt").stat().st_size > 0, export.stderr[-2000:]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_cli("eval", "models:/nope/1", cwd=elsewhere)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"rayjobs: error: eval: models:/nope/1 needs an MLflow store: none at {elsewhere / 'results' / 'mlflow.db'}; "
        "pass --tracking-uri"
    )
    proc = run_cli("predict", "runs:/0123abc", "--data", "x", "--out", "y", "--tracking-uri", store, cwd=elsewhere)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"rayjobs: error: predict: runs:/0123abc not found in {store}: "), proc.stderr
