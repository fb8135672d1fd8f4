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


@pytest.mark.slow
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
        # MLflow 3's job runner and its huey consumers (a Python with mlflow each) are not started
        import psutil

        family = [" ".join(p.cmdline()) for p in psutil.Process(proc.pid).children(recursive=True)]
        assert family and not [c for c in family if "huey" in c or "_job_runner" in c], family
    finally:
        import os
        import signal

        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)


@pytest.mark.skipif(find_chromium() is None, reason="Chromium not installed (make test installs it where apt works)")
@pytest.mark.slow
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


@pytest.mark.skipif(find_chromium() is None, reason="Chromium not installed (make test installs it where apt works)")
def test_screenshot_of_a_one_step_run_or_to_a_non_png_is_one_line(tmp_path):
    """A run of one point per metric drew no curve, and the refusal read like a failed page load."""
    from rayjobs.errors import ConfigError
    from rayjobs.screenshot import take

    sets = [f"run.storage_path={tmp_path}", "run.name=dot", "scaling.num_workers=0", "model.name=mlp"]
    train.run(load_config(None, [*sets, "training.max_steps=1"]))
    with pytest.raises(ConfigError, match=r"^screenshot: --out must end in \.png, got '.*x\.txt'$"):
        take(str(tmp_path), str(tmp_path / "x.txt"))
    with pytest.raises(ConfigError, match="^screenshot: run 'dot' logged at most one point of each metric, and a chart"):
        take(str(tmp_path), str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def _ui(storage, port: int, *extra: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rayjobs", "ui", "--storage-path", str(storage), "--port", str(port), *extra],
        cwd=REPO,
        env=subprocess_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _mlflow_processes(port: int) -> list:
    import psutil

    return [
        p for p in psutil.process_iter(["cmdline"]) if "--port" in (c := p.info["cmdline"] or []) and str(port) in c
    ]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
@pytest.mark.slow
def test_ui_stops_its_server_on_sigterm_and_sighup(trained, sig):
    import signal

    port = free_port()
    proc = _ui(trained, port)
    assert proc.stdout.readline().startswith("MLflow UI:")
    assert any("mlflow" in " ".join(p.info["cmdline"]) for p in _mlflow_processes(port))
    proc.send_signal(getattr(signal, sig))  # to rayjobs ui alone, as a service manager or a closed terminal does
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while _mlflow_processes(port) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _mlflow_processes(port), "the MLflow server outlived rayjobs ui"


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ui_stopped_while_its_server_starts_leaves_no_server(tmp_path, sig):
    """Ctrl-C in the seconds before the server answered left it running, on its port, for good."""
    import signal

    port = free_port()
    proc = _ui(tmp_path / "store", port)
    deadline = time.monotonic() + 60
    while not any("mlflow" in " ".join(p.info["cmdline"]) for p in _mlflow_processes(port)):
        assert time.monotonic() < deadline and proc.poll() is None, "rayjobs ui started no MLflow server"
        time.sleep(0.05)
    proc.send_signal(getattr(signal, sig))  # the server takes seconds to answer: it is still starting
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while _mlflow_processes(port) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _mlflow_processes(port), "the MLflow server outlived rayjobs ui, stopped while it started"
    assert "Traceback" not in proc.stdout.read()


def test_ui_on_a_busy_port_fails_in_one_line(trained):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _ui(trained, port)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert out.strip().splitlines() == [
        f"rayjobs: error: ui: port {port} on 127.0.0.1 is in use; stop what listens there or give --port"
    ]


@pytest.mark.slow
def test_ui_over_a_place_without_runs_says_its_store_is_new(tmp_path):
    """A mistyped --storage-path served an empty UI without a word (the store is made, for runs to log to)."""
    import signal

    port = free_port()
    proc = _ui(tmp_path / "nothing-here", port)
    try:
        assert proc.stdout.readline().startswith(f"MLflow UI: http://127.0.0.1:{port}")
        assert proc.stdout.readline() == (
            f"rayjobs: no runs there yet: a new, empty store; runs land in it with --set "
            f"run.storage_path={tmp_path / 'nothing-here'} or --set tracking.uri=http://127.0.0.1:{port}\n"
        )
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


@pytest.mark.slow
def test_ui_auth_rotates_the_admin_password_and_keeps_its_secrets_private(tmp_path):
    import base64
    import os
    import signal
    import stat
    import urllib.error

    def status(port: int, password: str) -> int:
        token = base64.b64encode(f"admin:{password}".encode()).decode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1",
            headers={"Authorization": f"Basic {token}"},
        )
        try:
            return urllib.request.urlopen(req, timeout=10).status
        except urllib.error.HTTPError as exc:
            return exc.code

    for password in ("first-Passw0rd!", "second-Passw0rd!"):
        port = free_port()
        proc = _ui(tmp_path, port, "--auth", MLFLOW_TRACKING_USERNAME="admin", MLFLOW_TRACKING_PASSWORD=password)
        try:
            lines = [proc.stdout.readline()]
            while not lines[-1].startswith("MLflow UI:") and len(lines) < 30:
                lines.append(proc.stdout.readline())
            assert lines[-1].startswith("MLflow UI:"), lines
            rotated = "rayjobs: ui --auth: admin password rotated to MLFLOW_TRACKING_PASSWORD\n" in lines
            assert rotated == password.startswith("second"), lines
            assert status(port, password) == 200
            assert status(port, "first-Passw0rd!" if password.startswith("second") else "wrong") == 401
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    for name in (".flask_secret", "basic_auth.ini"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600, name
