"""A headless-Chromium screenshot of the MLflow UI's metric chart for one run.

    rayjobs screenshot [--storage-path results] [--run RUN_NAME] --out mlflow-ui.png

Starts a temporary MLflow server on 127.0.0.1 over the run's store, opens the metric page of the
run (train loss, validation loss and accuracy against the step), saves a PNG, stops the server.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import urllib.parse
from pathlib import Path

from rayjobs.errors import ConfigError
from rayjobs.rundir import mlflow_db

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DEFAULT_METRICS = ["train/step_loss", "val/loss", "val/accuracy"]


def find_chromium() -> str | None:
    """The Chromium binary on PATH (Debian's package installs ``chromium``)."""
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def metric_page(experiment_id: str, run_id: str, keys: list[str]) -> str:
    """The UI route (after ``#``) of the metric chart of ``keys`` for one run, against the step."""
    query = {
        "runs": json.dumps([run_id]),
        "metric": json.dumps(keys[0]),
        "experiments": json.dumps([experiment_id]),
        "plot_metric_keys": json.dumps(keys),
        "plot_layout": json.dumps({"autosize": True}),
        "x_axis": "step",
        "y_axis_scale": "log",
        "line_smoothness": "1",
        "show_point": "true",
        "deselected_curves": "[]",
        "last_linear_y_axis_range": "[]",
    }
    return f"/metric/{urllib.parse.quote(keys[0], safe='')}?" + urllib.parse.urlencode(query)


def take(
    storage_path: str, out: str, run_name: str | None = None, experiment: str = "rayjobs", keys: list[str] | None = None
) -> str:
    """Screenshot the metric chart of a run in ``storage_path``'s MLflow store; returns the run id.

    The same page is also rendered to its DOM, and the screenshot is refused (ConfigError) when
    the chart drew no curve: a PNG of a page still loading proves nothing.
    """
    from rayjobs import mlflow_server
    from rayjobs.tracking import client

    if not out.lower().endswith(".png"):
        raise ConfigError(f"screenshot: --out must end in .png, got {out!r}")
    chromium = find_chromium()
    if chromium is None:
        raise ConfigError("screenshot: Chromium not found; install it (Debian: apt-get install chromium)")
    store = Path(storage_path).resolve()
    db = mlflow_db(store)
    if not os.path.exists(db):
        raise ConfigError(f"screenshot: no MLflow store at {db}; train a run with this storage path first")
    c = client(f"sqlite:///{db}")
    exp = c.get_experiment_by_name(experiment)
    runs = c.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"]) if exp else []
    if run_name:
        runs = [r for r in runs if r.info.run_name == run_name]
    if not runs:
        raise ConfigError(
            f"screenshot: no run{' named ' + repr(run_name) if run_name else ''} in experiment {experiment!r}"
        )
    run = runs[0]
    present = set(run.data.metrics)
    keys = [k for k in (keys or DEFAULT_METRICS) if k in present] or sorted(present)[:3]
    keys = [k for k in keys if len(c.get_metric_history(run.info.run_id, k)) >= 2]  # one point draws no curve
    if not keys:
        raise ConfigError(
            f"screenshot: run {run.info.run_name!r} logged at most one point of each metric, and a chart needs two; "
            "give --run NAME of a longer run (or log more often: training.log_every, training.eval_every)"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = mlflow_server.start(str(store), port)
    try:
        url = f"http://127.0.0.1:{port}/#{metric_page(exp.experiment_id, run.info.run_id, keys)}"
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        render = [chromium, *CHROMIUM_FLAGS, "--window-size=1400,900", "--virtual-time-budget=30000"]
        with tempfile.TemporaryDirectory() as profile:
            dom = subprocess.run(
                [*render, f"--user-data-dir={profile}", "--dump-dom", url],
                check=True,
                capture_output=True,
                text=True,
                timeout=180,
            ).stdout
        curves = dom.count('class="js-line"')
        if curves < len(keys):
            raise ConfigError(f"screenshot: the metric chart drew {curves} of {len(keys)} curves; not saving {out}")
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [*render, f"--user-data-dir={profile}", f"--screenshot={Path(out).resolve()}", url],
                check=True,
                capture_output=True,
                timeout=180,
            )
    finally:
        mlflow_server.stop(server)
    return run.info.run_id
