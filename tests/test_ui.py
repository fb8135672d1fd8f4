"""`rayjobs ui` serves the MLflow UI on 127.0.0.1; `rayjobs screenshot` captures a run's metric chart."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import REPO, free_port, subprocess_env

from rayjobs import train
from rayjobs.config import load_config
from rayjobs.screenshot import find_chromium


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui")
    train.run(
        load_config(
            None,
            [
                f"run.storage_path={root}",
                "run.name=shown",
                "scaling.num_workers=0",
                "model.name=mlp",
                "training.epochs=4",
                "training.eval_every=10",
                "tracking.log_every=2",
            ],
        )
    )
    return root


def test_ui_serves_on_loopback_and_prints_the_url(trained):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rayjobs", "ui", "--storage-path", str(trained), "--port", str(port)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"MLflow UI: http://127.0.0.1:{port}"), line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=5") as r:
            assert b'"rayjobs"' in r.read()
        listeners = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
        local_addresses = [line.split()[3] for line in listeners.splitlines() if line.strip()]
        assert local_addresses and all(a == f"127.0.0.1:{port}" for a in local_addresses), listeners
    finally:
        import os
        import signal

        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)


@pytest.mark.skipif(find_chromium() is None, reason="Chromium not installed (make test installs it where apt works)")
def test_screenshot_of_the_metric_chart(trained, tmp_path):
    out = tmp_path / "mlflow-ui.png"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rayjobs", "screenshot", "--storage-path", str(trained), "--out", str(out)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    assert Image.open(out).size == (1400, 900)
    assert "screenshot of run" in proc.stdout  # take() refuses a chart that drew no curve (checked in its DOM)
    assert time.monotonic() - started < 300


@pytest.mark.skipif(find_chromium() is None, reason="Chromium not installed (make test installs it where apt works)")
def test_screenshot_refuses_a_run_without_those_metrics(trained, tmp_path):
    from rayjobs.errors import ConfigError
    from rayjobs.screenshot import take

    with pytest.raises(ConfigError, match="no run named 'nope'"):
        take(str(trained), str(tmp_path / "x.png"), run_name="nope")
