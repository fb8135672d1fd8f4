"""The README is executable: every `rayjobs` / `python -m rayjobs` / `make train` command in its fenced
bash blocks (and cluster/README.md's) runs as written, in order, from one fresh directory outside
the repo, with only the repo's venv on PATH, and exits 0 (or the status its comment names), with
the key figure the README shows.

A command that cannot run here is listed in NOT_RUN with its reason; a README command that is
neither run nor listed fails the test, so a new command cannot go untested unnoticed.

    .venv/bin/python -m pytest tests/test_readme.py
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, VENV_BIN

from rayjobs.rundir import RunDir

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RUNS = re.compile(r"^(?:[A-Z_]+=\S+ )*(rayjobs\b|python -m rayjobs\b|make train\b)")

NOT_RUN = {
    "make train": ".ci/run runs it first on the clean clone and checks test accuracy >= 0.97 "
    "(test_ci_runs_make_train_first checks that it does)",
    "rayjobs tune --config tune-digits --summary results/tune-summary.json": "6 trials of the full job take "
    "about 6 minutes here; the quick form below runs the same config and code",
    "rayjobs train --config gpt-fsdp": "gpt small under FSDP2 is the GPU form (one worker per GPU); "
    "the gpt-fsdp-tp line after it is the CPU form and runs",
    "rayjobs train --config gpt-fsdp --set scaling.num_workers=4": "4 GPUs; on CPU tests/dist/test_strategies.py "
    "trains the shipped FSDP configs in their debug form",
    "RAY_ADDRESS=127.0.0.1:6379 rayjobs doctor --set run.storage_path=/mnt/shared/results "
    "--set tracking.uri=http://mlflow:5000": "needs /mnt/shared and an MLflow host named mlflow; "
    "the local-cluster block runs `rayjobs doctor`",
    "rayjobs train --set run.storage_path=s3://my-bucket/runs --set tracking.uri=http://MLFLOW-HOST:5000": "a real "
    "bucket and MLflow host (no network here); tests/dist/test_object_store.py runs it against a local S3 server",
}

# Servers: started in the background, probed, then stopped (Ctrl-C) before the next command.
SERVERS = {"rayjobs ui": "http://127.0.0.1:5000/health"}


@dataclass
class Command:
    text: str  # as written (continuations joined)
    source: str  # README.md or cluster/README.md
    expect_rc: int = 0
    block: int = 0  # which ```bash block of its file


def readme_commands(path: Path) -> list[Command]:
    """Every command line of the file's ```bash blocks, continuations joined, comments kept apart."""
    out = []
    for block_no, block in enumerate(re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1].rstrip() + " " + lines[i].strip()
            i += 1
            if line.strip().startswith("#"):
                continue
            text, *comment = re.split(r"\s#(?:\s|$)", line.strip(), maxsplit=1)
            text = re.sub(r"\s+", " ", text.strip())
            if not text:
                continue
            rc = re.search(r"exits (\d+)", comment[0] if comment else "")
            out.append(Command(text, str(path.relative_to(REPO)), int(rc.group(1)) if rc else 0, block_no))
    return out


ALL = readme_commands(REPO / "README.md") + readme_commands(REPO / "cluster" / "README.md")
RUN = [c for c in ALL if RUNS.match(c.text) and c.text not in NOT_RUN]
# An `export` line sets the environment of the rayjobs commands after it in its block.
_RUN_BLOCKS = {(c.source, c.block) for c in RUN}
RUN = [c for c in ALL if c in RUN or (c.text.startswith("export ") and (c.source, c.block) in _RUN_BLOCKS)]
# cluster/README.md repeats README.md's local-cluster block: that sequence runs once.
RUN = [c for i, c in enumerate(RUN) if c.text not in {d.text for d in RUN[:i] if d.source != c.source}]


def test_every_command_is_run_or_listed_with_its_reason():
    rayjobs_commands = {c.text for c in ALL if RUNS.match(c.text)}
    assert rayjobs_commands, "no command found in the README"
    stale = set(NOT_RUN) - rayjobs_commands
    assert not stale, f"NOT_RUN names commands the README no longer has: {stale}"


def test_ci_runs_make_train_first():
    ci = (REPO / ".ci" / "run").read_text()
    assert ci.index("make train") < ci.index("make test")
    assert "test/accuracy" in ci and "0.97" in ci


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """A fresh directory outside the repo: the user's files the README's commands name, nothing else."""
    d = tmp_path_factory.mktemp("user")
    readme = (REPO / "README.md").read_text()
    my_net = re.search(r"```python\n# my_net.py\n(.*?)```", readme, re.S)
    assert my_net, "README's my_net.py example is gone"
    (d / "my_net.py").write_text(my_net.group(1))
    my_task = re.search(r"```python\n# my_task.py\n(.*?)```", readme, re.S)
    assert my_task, "README's my_task.py example is gone"
    (d / "my_task.py").write_text(my_task.group(1))
    tiny = re.search(r"```python\n# tiny_gpt2.py[^\n]*\n(.*?)```", readme, re.S)
    assert tiny, "README's tiny_gpt2.py example is gone"
    (d / "tiny_gpt2.py").write_text(tiny.group(1))
    subprocess.run([sys.executable, "tiny_gpt2.py"], cwd=d, check=True, timeout=120)  # as the README says
    (d / "my_csvs").mkdir()
    rows = ["a,b,y", *(f"{i % 7},{(i * 3) % 5},{i % 2}" for i in range(200))]
    (d / "my_csvs" / "part.csv").write_text("\n".join(rows) + "\n")
    # 45 KB of training text, 9 KB held out: the text commands' runs are a few steps an epoch, and
    # each evaluation a few batches (at 90 KB each, evaluating cost more than training).
    for folder, repeats in (("corpus", 1000), ("held_out", 200)):
        (d / folder).mkdir()
        (d / folder / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * repeats)
    return d


@pytest.fixture(scope="module")
def user_env(tmp_path_factory):
    """The user's environment: the venv on PATH, nothing of the repo on PYTHONPATH; `export` lines add to it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "RAY_ADDRESS"))}
    env.pop("PYTHONPATH", None)
    env["PATH"] = os.pathsep.join([VENV_BIN, env.get("PATH", "")])
    return env


def _wait_for(url: str, timeout: float = 90.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return urllib.request.urlopen(url, timeout=5).status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _assert_nothing_listens_on(port: int) -> None:
    """Fail, naming the port, where another process (a `rayjobs ui` left over) already serves on it."""
    import socket

    with socket.socket() as probe:
        taken = probe.connect_ex(("127.0.0.1", port)) == 0
    assert not taken, f"something already listens on 127.0.0.1:{port} (a leftover `rayjobs ui`?); stop it and rerun"


_OUTPUTS: dict[str, str] = {}  # each command's output, for a later command's check that compares


def _steps(out: str) -> int:
    """The steps of the run that a `rayjobs train` output says finished."""
    found = re.findall(r"finished in [\d.]+ s \(.*?, (\d+) steps\)", out)
    assert found, out[-2000:]
    return int(found[-1])


def _check_figures(cmd: Command, out: str, cwd: Path) -> None:
    """The key figure the README shows for the commands that show one."""
    accuracy = re.findall(r"test/accuracy (\d\.\d+)", out)
    if cmd.text == "rayjobs train" or "data.kwargs.path=data/digits" in cmd.text:
        assert accuracy and float(accuracy[-1]) >= 0.97, out[-3000:]
    if cmd.text == "rayjobs train":  # the launch timeline, phase by phase, as the README shows it
        assert re.search(r"first step after \d+\.\d s: driver \d+\.\d s, ray \d+\.\d s, .*workers", out), out[-3000:]
    if "model.name=hf:tiny-gpt2" in cmd.text:  # a transformers model on the byte corpus: it learns
        loss = re.findall(r"val/loss (\d+\.\d+)", out)
        assert loss and float(loss[-1]) < 4.0 and "val/perplexity" in out, out[-3000:]
        assert "fsdp: dp_shard=2" in out, out[-3000:]  # 2 Ray workers, FSDP2 per decoder layer
        evals = [h for h in RunDir(str(cwd / "results" / "tiny-gpt2-text")).read_history() if "val/loss" in h]
        assert [h["step"] for h in evals] == [10, 20] and _steps(out) == 20, evals
        assert evals[-1]["val/loss"] < evals[0]["val/loss"] < 5.6, evals  # ln(256) = 5.55 at random
    if "model.name=my_net:build" in cmd.text:
        assert accuracy and float(accuracy[-1]) >= 0.90, out[-3000:]
    if cmd.text.startswith("rayjobs data prepare digits"):
        meta = json.loads((cwd / "data" / "digits" / "rayjobs-data.json").read_text())
        assert meta["rows"] == {"train": 1257, "val": 270, "test": 270}, meta
    if "data.kwargs.path=data/digits" in cmd.text:  # tracking on: a FINISHED MLflow run with the model
        import mlflow

        mlflow.set_tracking_uri(f"sqlite:///{cwd / 'results' / 'mlflow.db'}")
        runs = mlflow.search_runs(experiment_names=["rayjobs"], filter_string="tags.`run.name` = 'digits_cnn-parquet'")
        assert len(runs) == 1 and runs.iloc[0]["status"] == "FINISHED", runs
        assert runs.iloc[0]["tags.rayjobs.model_uri"].startswith("models:/")
        assert 0 <= runs.iloc[0]["metrics.perf/data_wait_fraction"] <= 1, runs.iloc[0]
        # The same job as the bundled default (`rayjobs train` above): as many steps (equal shards, full
        # batches), and about as accurate.
        bundled = _OUTPUTS.get("rayjobs train")
        assert bundled, "compares with the default job's run: run the whole module, not this command alone"
        assert _steps(out) == _steps(bundled) == 15 * (1257 // 64), (out[-1000:], bundled[-1000:])
        bundled_accuracy = float(re.findall(r"test/accuracy (\d\.\d+)", bundled)[-1])
        assert abs(float(accuracy[-1]) - bundled_accuracy) <= 0.03, (accuracy, bundled_accuracy)
    if "--summary out.json" in cmd.text:
        assert json.loads((cwd / "out.json").read_text())["metrics"]["step"] == 2 * (1257 // 64)
    if cmd.text == "rayjobs train --config regression-diabetes":
        r2 = re.findall(r"test/r2 (-?\d\.\d+)", out)
        assert r2 and float(r2[-1]) >= 0.4, out[-3000:]
    if "task.name=my_task:build" in cmd.text:  # the user's own metric, printed and in MLflow
        assert re.search(r"val/within_half \d\.\d+", out), out[-3000:]
        import mlflow

        mlflow.set_tracking_uri(f"sqlite:///{cwd / 'results' / 'mlflow.db'}")
        runs = mlflow.search_runs(experiment_names=["rayjobs"], filter_string="metrics.`val/within_half` >= 0")
        assert len(runs) >= (3 if cmd.text.startswith("rayjobs tune") else 1), runs
    if cmd.text.startswith("rayjobs eval models:/digits-best/"):  # the registered best trial's checkpoint
        assert re.search(r"eval of \w+ at step \d+ on digits/test \(270 rows", out), out[-2000:]
        assert accuracy and float(accuracy[-1]) >= 0.8, out[-2000:]
    if cmd.text.startswith("rayjobs eval results/digits-ddp/"):  # the run's own test accuracy, exactly
        import mlflow

        mlflow.set_tracking_uri(f"sqlite:///{cwd / 'results' / 'mlflow.db'}")
        runs = mlflow.search_runs(experiment_names=["rayjobs"], filter_string="tags.`run.name` = 'digits-ddp'")
        evaluated = json.loads((cwd / "eval.json").read_text())["metrics"]
        assert evaluated["test/accuracy"] == runs.iloc[0]["metrics.test/accuracy"], (evaluated, runs.iloc[0])
        assert f"test/accuracy {evaluated['test/accuracy']:.4f}" in out
    if cmd.text.startswith("rayjobs predict"):  # one prediction per input row, as accurate as the run
        import pyarrow.parquet as pq

        got = pq.read_table(cwd / "predictions").to_pandas()
        assert "predicted 270 rows" in out and len(got) == 270, out[-2000:]
        assert (got["prediction"] == got["label"]).mean() >= 0.97
    if cmd.text == "rayjobs configs":
        assert "gpt-fsdp " in out and "digits " in out
    if "raise_at_step=53" in cmd.text and cmd.expect_rc == 0:
        assert "resumed from" in out and "at step 50" in out, out[-3000:]
    if cmd.text.startswith("rayjobs checkpoints demo"):
        assert "checkpoint_00000117" in out
    if cmd.text.startswith("rayjobs tune") and "--resume" not in cmd.text:
        assert "[tune]" in out and "trial " in out  # the trials table
    if cmd.text.startswith("rayjobs tune") and "--resume" in cmd.text:  # a finished search: nothing registered twice
        import mlflow

        mlflow.set_tracking_uri(f"sqlite:///{cwd / 'results' / 'mlflow.db'}")
        versions = mlflow.MlflowClient().search_model_versions("name = 'digits-best'")
        assert len(versions) == 1, versions
    if cmd.text.startswith("rayjobs export"):
        assert (cwd / "weights.safetensors").stat().st_size > 0


@pytest.mark.parametrize("cmd", RUN, ids=[f"{c.source}: {c.text[:70]}" for c in RUN])
def test_readme_command_runs_as_written(cmd: Command, user_dir: Path, user_env: dict):
    if cmd.text.startswith("export "):
        for name, value in (part.split("=", 1) for part in shlex.split(cmd.text)[1:]):
            user_env[name] = value
        return
    if cmd.text.startswith("rayjobs screenshot") and not any(
        Path(d, "chromium").exists() for d in os.environ.get("PATH", "").split(os.pathsep)
    ):
        pytest.skip("no Chromium on this machine (make test installs Debian's where apt works)")
    server = None
    is_ui = re.search(r"\brayjobs ui\b", cmd.text) is not None
    if is_ui or "127.0.0.1:5000" in cmd.text:
        _assert_nothing_listens_on(5000)  # else the checks below would probe some other server
    if "tracking.uri=http://127.0.0.1:5000" in cmd.text:  # "with `rayjobs ui` running"
        server = subprocess.Popen(["rayjobs", "ui"], cwd=user_dir, env=user_env, start_new_session=True)
        _wait_for("http://127.0.0.1:5000/health")
    try:
        if is_ui:  # a server: up, answering (401 without credentials under --auth)
            proc = subprocess.Popen(cmd.text, shell=True, cwd=user_dir, env=user_env, start_new_session=True)
            try:
                status = _wait_for(SERVERS["rayjobs ui"].replace("/health", "/"))
                assert proc.poll() is None, f"{cmd.text} exited with status {proc.returncode}"
                assert status == (401 if "--auth" in cmd.text else 200), status
            finally:
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(timeout=60)
            return
        proc = subprocess.run(
            cmd.text, shell=True, cwd=user_dir, env=user_env, capture_output=True, text=True, timeout=900
        )
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGINT)
            server.wait(timeout=60)
    if cmd.text.startswith("rayjobs cluster down"):
        user_env.pop("RAY_ADDRESS", None)  # the shell's export is gone with the cluster
    out = proc.stdout + proc.stderr
    assert proc.returncode == cmd.expect_rc, f"{cmd.text}\nexit {proc.returncode}\n{out[-4000:]}"
    if cmd.expect_rc == 2:  # a user's mistake: one line, never a traceback (a failed training shows its own)
        assert "Traceback" not in out, out[-3000:]
    _OUTPUTS[cmd.text] = out
    _check_figures(cmd, out, user_dir)
