"""``rayjobs cluster up|down``: the local autoscaling cluster of ``cluster/local-autoscale.yaml``.

``up`` runs ``RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...`` with the head on
127.0.0.1 (dashboard and Jobs API too) and Ray's token auth on: worker nodes are real Ray nodes,
started on this machine by the autoscaler when work needs them and stopped when idle. The head
has 0 CPUs (as the YAML says), so training always runs on nodes the autoscaler launched.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from rayjobs.errors import ConfigError

LOCAL_YAML = Path(__file__).resolve().parents[1] / "cluster" / "local-autoscale.yaml"
TOKEN_FILE = Path.home() / ".ray" / "auth_token"
# Where `rayjobs cluster up` notes the cluster it started (one file per GCS port), so that `down`
# stops that cluster's processes and no other Ray on the machine (a local `rayjobs train` beside it).
RECORDS = Path.home() / ".cache" / "rayjobs" / "clusters"


@dataclass
class LocalCluster:
    """Where a started local autoscaling cluster listens, and how a client authenticates."""

    gcs_address: str
    dashboard_url: str
    temp_dir: str
    token: str

    def env(self) -> dict[str, str]:
        """The environment a client (``ray job submit``, a driver) needs to use this cluster."""
        return {"RAY_ADDRESS": self.gcs_address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}


def record(started: LocalCluster) -> Path:
    """Note a cluster ``up`` started, for ``down`` (``~/.cache/rayjobs/clusters/<port>.json``, no token)."""
    RECORDS.mkdir(parents=True, exist_ok=True)
    path = RECORDS / f"{started.gcs_address.rsplit(':', 1)[1]}.json"
    noted = {"gcs_address": started.gcs_address, "dashboard_url": started.dashboard_url, "temp_dir": started.temp_dir}
    path.write_text(json.dumps(noted))
    return path


def recorded(port: int) -> LocalCluster | None:
    """The cluster ``up`` started on ``port``, as noted by ``record`` (None where none is noted)."""
    try:
        noted = json.loads((RECORDS / f"{port}.json").read_text())
        return LocalCluster(noted["gcs_address"], noted["dashboard_url"], noted["temp_dir"], token="")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def forget(port: int) -> None:
    """Drop the note of the cluster on ``port`` (it was stopped)."""
    (RECORDS / f"{port}.json").unlink(missing_ok=True)


def _token_file() -> str:
    """The token in Ray's default file (clients on this machine read it there); made when missing."""
    if not TOKEN_FILE.is_file():
        TOKEN_FILE.parent.mkdir(parents=True, exist_ok=True)
        TOKEN_FILE.touch(mode=0o600)
        TOKEN_FILE.write_text(secrets.token_hex(16))
    return TOKEN_FILE.read_text().strip()


def _ray_bin() -> str:
    return str(Path(sys.executable).parent / "ray")


def autoscaling_config(source: Path, gcs_address: str, out_dir: str) -> str:
    """The cluster YAML with the provider pointed at this head's GCS (the fake provider defaults to :6379)."""
    try:
        config = yaml.safe_load(source.read_text())
    except OSError as exc:
        raise ConfigError(f"cluster config: cannot read {source}: {exc.strerror}") from None
    if config.get("provider", {}).get("type") != "fake_multinode":
        raise ConfigError(f"cluster config: {source} is not a fake_multinode cluster; use `ray up {source}` for clouds")
    config["provider"]["gcs_address"] = gcs_address
    out = os.path.join(out_dir, "autoscaling.yaml")
    Path(out).write_text(yaml.safe_dump(config))
    return out


def up(
    config: Path = LOCAL_YAML,
    port: int = 6379,
    dashboard_port: int = 8265,
    temp_dir: str | None = None,
    token: str | None = None,
) -> LocalCluster:
    """Start the head of the local autoscaling cluster; worker nodes come and go with demand."""
    from rayjobs.mlflow_server import port_in_use

    own_temp_dir = temp_dir is None
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="rjc-", dir="/tmp")  # Ray's socket paths must stay short
    token = token or os.environ.get("RAY_AUTH_TOKEN") or _token_file()
    gcs = f"127.0.0.1:{port}"
    try:
        yaml_path = autoscaling_config(Path(config), gcs, temp_dir)
        # `ray start` on a dashboard port another Ray holds started no dashboard and said nothing: the
        # `ray job submit --address` printed for this cluster then sent the job to that other Ray.
        for flag, wanted in (("--port", port), ("--dashboard-port", dashboard_port)):
            if port_in_use(wanted):
                raise ConfigError(
                    f"cluster up {flag} {wanted}: 127.0.0.1:{wanted} is in use (another Ray?); "
                    f"stop what listens there or give another {flag}"
                )
    except ConfigError:
        if own_temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    cmd = [
        _ray_bin(),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        "--dashboard-agent-listen-port=0",  # not Ray's fixed 52365: another Ray here may hold it
        "--num-cpus=0",
        f"--autoscaling-config={yaml_path}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise ConfigError(f"cluster up: `ray start --head` failed: {tail[0]}")
    return LocalCluster(gcs, f"http://127.0.0.1:{dashboard_port}", temp_dir, token)


def down(started: LocalCluster) -> None:
    """Stop a local cluster: its head, the autoscaler and every worker node it started, found by its
    temp dir and GCS port, so that other Rays on the machine live on."""
    port = started.gcs_address.rsplit(":", 1)[1]
    stop_processes([re.escape(started.temp_dir), rf":{port}\b"])


def stop_processes(patterns: list[str], timeout: float = 3.0) -> None:
    """Terminate (then kill) every process whose command line matches one of ``patterns``, with its children.

    Ray's GCS, raylets, autoscaler and runtime-env agent outlast a SIGTERM by over 10 s (a ``cluster
    down`` waited 10 s for them); ``ray stop --force`` kills them outright, this after ``timeout``."""
    import psutil

    found = re.compile("|".join(f"(?:{p})" for p in patterns))
    roots = [p for p in psutil.process_iter(["cmdline"]) if found.search(" ".join(p.info["cmdline"] or []))]
    procs: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        procs.update({p.pid: p for p in family if p.pid != os.getpid()})
    for p in procs.values():
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
