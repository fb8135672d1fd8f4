"""The local autoscaling cluster of cluster/local-autoscale.yaml (Ray's fake_multinode provider):
worker nodes start on demand and go when idle; a job submitted with `ray job submit` succeeds; an
elastic run starts small and grows; a killed node is replaced and the run resumes; `rayjobs doctor`
passes, and fails on storage that one node cannot see. One cluster for the module."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import REPO, VENV_BIN, free_port, subprocess_env

from rayjobs import checkpoint as ckpt
from rayjobs import cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def local_cluster(request):
    """The autoscaling cluster of `rayjobs cluster up`, token auth on; its temp dir (Ray's session
    logs, about 6 MB) is removed after it, and kept where a test of the module failed."""
    import os
    import secrets

    failed_before = request.session.testsfailed
    token = secrets.token_hex(16)
    saved = dict(os.environ)
    # `ray start` and the autoscaler it runs inherit the token. This process watches the cluster
    # over HTTP (the dashboard's state API), not as a Ray driver: Ray fixes a process's auth mode
    # when it is first imported, and other test modules import it first.
    os.environ.update(subprocess_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token))
    temp_dir = tempfile.mkdtemp(prefix="rjc-", dir="/tmp")
    started = cluster.up(cluster.LOCAL_YAML, free_port(), free_port(), temp_dir=temp_dir, token=token)
    try:
        yield started
    finally:
        cluster.down(started)
        os.environ.clear()
        os.environ.update(saved)
        if request.session.testsfailed == failed_before:
            shutil.rmtree(temp_dir, ignore_errors=True)
        else:
            print(f"the cluster's logs are kept in {temp_dir}")


def alive_nodes(started: cluster.LocalCluster) -> list[dict]:
    """The cluster's alive nodes from the dashboard's state API (node_id, node_ip, is_head_node, resources_total)."""
    nodes = get_json(started, "/api/v0/nodes?limit=1000&detail=1")["data"]["result"]["result"]
    return [n for n in nodes if n["state"] == "ALIVE"]


def worker_nodes(started: cluster.LocalCluster) -> list[dict]:
    return [n for n in alive_nodes(started) if not n["is_head_node"]]


def cluster_cpus(started: cluster.LocalCluster) -> float:
    return sum(n["resources_total"].get("CPU", 0) for n in alive_nodes(started))


def submit(started: cluster.LocalCluster, *args: str) -> str:
    env = subprocess_env(**started.env())
    cmd = [
        f"{VENV_BIN}/ray",
        "job",
        "submit",
        "--address",
        started.dashboard_url,
        "--working-dir",
        str(REPO),
        "--no-wait",
        "--",
        sys.executable,
        "-m",
        "rayjobs.train",
        *args,
    ]
    for _ in range(30):  # right after `ray start` the head's job agent may not have registered yet
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
        if "No available agent to submit job" not in out.stderr:
            break
        time.sleep(2)
    assert out.returncode == 0, out.stderr[-2000:]
    return next(w.strip("'") for line in out.stdout.splitlines() for w in line.split() if w.startswith("'raysubmit_"))


def get_json(started: cluster.LocalCluster, path: str) -> dict:
    """GET a dashboard endpoint with the cluster's token."""
    import json
    import urllib.request

    req = urllib.request.Request(started.dashboard_url + path, headers={"Authorization": f"Bearer {started.token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def job_status(started: cluster.LocalCluster, job_id: str) -> tuple[str, str]:
    """(status, logs) of a submitted job, from the Jobs API."""
    return get_json(started, f"/api/jobs/{job_id}")["status"], get_json(started, f"/api/jobs/{job_id}/logs")["logs"]


def wait_for(predicate, timeout: float, what: str, every: float = 1.0, explain=None):
    """Poll `predicate` until it returns something truthy; on timeout fail, adding what `explain()` says."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}" + (f"\n{explain()}" if explain else ""))


def diagnosis(started: cluster.LocalCluster, job: str) -> str:
    """What a stuck job's failure message needs: its status and log tail, the alive nodes and their
    resources, and the Train controllers' last scaling decisions (from the cluster's session logs)."""
    from pathlib import Path

    status, logs = job_status(started, job)
    nodes = [f"{n['node_id'][:8]} head={n['is_head_node']} {n['resources_total']}" for n in alive_nodes(started)]
    decisions = [
        line[:300]
        for log in sorted(Path(started.temp_dir).glob("session_latest/logs/train/ray-train-sys-controller-*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "Detected" in line or "Requesting resources" in line or "Failed to" in line
    ]
    return "\n".join(
        [
            f"job {status}; its log ends:",
            logs[-2000:],
            "alive nodes:",
            *nodes,
            "controller decisions:",
            *decisions[-12:],
        ]
    )


ENDED = ("SUCCEEDED", "FAILED", "STOPPED")  # a job's terminal statuses in the Jobs API


def finished_job(started: cluster.LocalCluster, job: str, seen: set[str] | None = None):
    """A wait_for predicate: (status, logs) once the job ended; notes the worker nodes it sees."""

    def check():
        if seen is not None:
            seen.update(n["node_id"] for n in worker_nodes(started))
        status, logs = job_status(started, job)
        return (status, logs) if status in ENDED else None

    return check


def first_checkpoint_while_running(started: cluster.LocalCluster, job: str, run_dir):
    """A wait_for predicate: the run's first complete checkpoint; fails at once, with the diagnosis,
    if the job ends before it (no waiting out the deadline on a job that is gone)."""

    def check():
        found = ckpt.latest_complete(run_dir, warn=False)
        if not found and (status := get_json(started, f"/api/jobs/{job}")["status"]) in ENDED:  # no log fetch per poll
            pytest.fail(f"the job ended {status} before its first checkpoint\n{diagnosis(started, job)}")
        return found

    return check


def resumed_steps(logs: str) -> list[int]:
    return [int(line.split(" at step ")[1].split()[0]) for line in logs.splitlines() if "resumed from" in line]


def kill_node(node_id: str) -> None:
    """SIGKILL a node's raylet: the node dies, and the workers on it with it."""
    import psutil

    raylets = [
        p
        for p in psutil.process_iter(["cmdline"])
        if (cmd := " ".join(p.info["cmdline"] or [])).split(" ", 1)[0].endswith("raylet")
        and f"--node_id={node_id}" in cmd
    ]
    assert raylets, f"no raylet process for node {node_id}"
    for p in raylets:
        p.kill()


def test_a_submitted_job_brings_up_nodes_survives_losing_one_and_they_go_when_idle(local_cluster, tmp_path):
    """`ray job submit` of the default training: worker nodes launch on demand; one killed mid-run is
    launched again and training resumes from its checkpoint; the job succeeds; idle nodes go away."""
    assert cluster_cpus(local_cluster) == 0 and not worker_nodes(local_cluster)  # a head with 0 CPUs, no workers
    run_dir = tmp_path / "digits-ddp"
    job = submit(
        local_cluster,
        # 30 epochs (570 steps, about 10 s of training here): still running when the test kills a node.
        *("--set", f"run.storage_path={tmp_path}", "--set", "training.epochs=30", "--set", "scaling.num_workers=2"),
        *("--set", "checkpoint.every_steps=20", "--set", "failure.max_failures=2"),
        *("--set", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "--summary", str(tmp_path / "summary.json")),
    )
    wait_for(
        first_checkpoint_while_running(local_cluster, job, run_dir),
        420,
        "a first checkpoint",
        every=0.5,
        explain=lambda: diagnosis(local_cluster, job),
    )
    before = {n["node_id"] for n in worker_nodes(local_cluster)}
    assert len(before) >= 2  # 2 workers of 1 CPU each: two cpu_worker nodes were launched for them
    killed_at = ckpt.latest_complete(run_dir, warn=False).step
    kill_node(sorted(before)[0])

    seen = set(before)
    status, logs = wait_for(finished_job(local_cluster, job, seen), 480, "the job to finish", every=2)
    assert status == "SUCCEEDED", logs[-3000:]
    assert seen - before, "the autoscaler launched no node after the kill"
    assert any(step >= killed_at for step in resumed_steps(logs)), logs[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_workers"] == 2 and summary["metrics"]["test/accuracy"] > 0.9
    wait_for(lambda: not worker_nodes(local_cluster), 180, "the idle worker nodes to go away", every=2)


def test_doctor_passes_on_the_cluster_and_names_storage_a_node_cannot_see(local_cluster, tmp_path):
    env = subprocess_env(**local_cluster.env())
    doctor = [sys.executable, "-m", "rayjobs", "doctor", "--set", f"run.storage_path={tmp_path}"]
    report = tmp_path / "doctor.json"
    ok = subprocess.run(
        [*doctor, "--summary", str(report)], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr[-3000:]
    assert "storage" in ok.stdout and "all" in ok.stdout and "checks passed" in ok.stdout
    checks = json.loads(report.read_text())["checks"]
    assert checks and all(c["status"] != "FAIL" for c in checks) and any(c["name"] == "token auth" for c in checks)
    assert "/api/jobs/ refuses a request without the token (401)" in ok.stdout, ok.stdout

    # A node whose view of the storage directory is its own (a tmpfs in a private mount namespace).
    hidden = tmp_path / "node-local"
    hidden.mkdir()
    node = subprocess.Popen(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"mount -t tmpfs none {hidden} && exec {VENV_BIN}/ray start --address={local_cluster.gcs_address} "
            "--num-cpus=1 --resources='{\"island\": 1}' --block --disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        island = lambda: any("island" in n["resources_total"] for n in alive_nodes(local_cluster))  # noqa: E731
        wait_for(island, 120, "the extra node to join")
        bad = subprocess.run(
            [*doctor[:-1], f"run.storage_path={hidden}"], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
        )
        assert bad.returncode == 1, bad.stdout + bad.stderr[-3000:]
        last = bad.stderr.strip().splitlines()[-1]
        assert "is not shared" in last and str(hidden) in last, bad.stderr[-2000:]

        # A training run whose worker lands on that node fails at once, saying so in one line.
        train = [sys.executable, "-m", "rayjobs", "train", "--set", f"run.storage_path={hidden}"]
        train += ["--set", "scaling.num_workers=1", "--set", "scaling.resources_per_worker={CPU: 1, island: 1}"]
        train += ["--set", "tracking.enabled=false"]
        failed = subprocess.run(train, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
        assert failed.returncode == 1, failed.stderr[-3000:]
        last = failed.stderr.strip().splitlines()[-1]
        assert last.startswith("rayjobs: training failed: ") and "run.storage_path is not shared" in last, last
    finally:
        node.terminate()
        node.wait(timeout=60)
        cluster.stop_processes([r"island"])


def test_an_elastic_run_starts_at_its_minimum_and_grows_when_a_node_joins(local_cluster, tmp_path):
    """Workers need an `elastic` resource no autoscaled node type has, so nodes join when the test says:
    one node -> the run starts with 1 worker; a second node joins -> it grows to 2 and finishes."""
    env = subprocess_env(**local_cluster.env())
    job = submit(
        local_cluster,
        *("--set", f"run.storage_path={tmp_path}", "--set", "run.name=elastic"),
        *("--set", "scaling.num_workers=[1, 2]", "--set", "scaling.resources_per_worker={CPU: 1, elastic: 1}"),
        *("--set", "scaling.elastic_resize_interval_s=5", "--set", "failure.max_failures=2"),
        # 60 epochs: about a minute on one worker here, time for a node to join and the group to grow.
        *("--set", "training.epochs=60", "--set", "checkpoint.every_steps=20", "--set", "tracking.enabled=false"),
    )

    node_dirs: list[str] = []

    def join(name: str) -> subprocess.Popen:
        # Its own temp dir, as another machine has its own disk: nodes of one host that share the head's
        # unpack a job's working_dir into one folder, and a joining node's unpack (Ray's overwrite=True)
        # deletes the folder the running driver stands in (its os.getcwd() then fails).
        node_dirs.append(tempfile.mkdtemp(prefix="rjn-", dir="/tmp"))  # Ray's socket paths must stay short
        cmd = [f"{VENV_BIN}/ray", "start", f"--address={local_cluster.gcs_address}", "--num-cpus=1"]
        cmd += [f"--resources={json.dumps({'elastic': 1, name: 1})}", "--block", "--disable-usage-stats"]
        cmd += [f"--temp-dir={node_dirs[-1]}"]
        out = tmp_path / f"{name}.out"
        with out.open("w") as sink:
            node = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)

        def joined() -> bool:
            if node.poll() is not None:
                pytest.fail(f"`ray start` of node {name} exited {node.returncode}: {out.read_text()[-2000:]}")
            return any(name in n["resources_total"] for n in alive_nodes(local_cluster))

        wait_for(joined, 120, f"node {name} to join")
        return node

    def starts(logs: str) -> list[int]:  # the worker-group size of each attempt, from its first log line
        lines = logs.splitlines()
        return [int(line.split(" worker(s) on ")[0].rsplit(" ", 1)[1]) for line in lines if " worker(s) on " in line]

    def started() -> list[int]:
        status, logs = job_status(local_cluster, job)
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            pytest.fail(f"the elastic job ended {status} before it started:\n{logs[-3000:]}")
        return starts(logs)

    explain = lambda: diagnosis(local_cluster, job)  # noqa: E731
    nodes: list[subprocess.Popen] = []
    try:
        nodes.append(join("elastic_a"))
        # Ray Train's elastic policy starts once the cluster-wide AutoscalingCoordinator reserves a
        # node for it; the coordinator looks at the cluster every 20 s.
        wait_for(started, 300, "the run to start on one node", 2, explain)
        nodes.append(join("elastic_b"))
        status, logs = wait_for(finished_job(local_cluster, job), 480, "the elastic job to finish", 2, explain)
        assert status == "SUCCEEDED", logs[-3000:]
        sizes = starts(logs)
        assert sizes[0] == 1 and 2 in sizes, sizes  # started at its minimum, grew when the node joined
        assert resumed_steps(logs), logs[-3000:]  # the grown group resumed from a checkpoint
    finally:
        for node in nodes:
            node.terminate()
        for node in nodes:
            node.wait(timeout=60)
        cluster.stop_processes([r"elastic_[ab]", *map(re.escape, node_dirs)])
        for node_dir in node_dirs:
            shutil.rmtree(node_dir, ignore_errors=True)


def listeners() -> list[tuple[str, int, str]]:
    """(address, port, process) of every listening TCP socket, from `ss -ltnpH`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        host, port = parts[3].rsplit(":", 1)
        rows.append((host.strip("[]").removeprefix("::ffff:"), int(port), parts[-1] if "users:" in parts[-1] else ""))
    return rows


def http_status(url: str, headers: dict | None = None) -> int | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except Exception:  # noqa: BLE001 - not an HTTP server
        return None


def test_dashboard_jobs_api_and_mlflow_listen_on_loopback_and_want_the_token(local_cluster, mlflow_server):
    dashboard_port = int(local_cluster.dashboard_url.rsplit(":", 1)[1])
    rows = listeners()
    for port in (dashboard_port, mlflow_server["port"]):
        bound = {host for host, p, _ in rows if p == port}
        assert bound == {"127.0.0.1"}, (port, bound)
    assert http_status(f"{local_cluster.dashboard_url}/api/jobs/") == 401  # the Jobs API without the token
    token = {"Authorization": f"Bearer {local_cluster.token}"}
    assert http_status(f"{local_cluster.dashboard_url}/api/jobs/", token) == 200
    # Ray's per-node agents serve HTTP on the node's address (the head's dashboard reaches them there):
    # without the token they refuse.
    node_ip = alive_nodes(local_cluster)[0]["node_ip"]
    agents = {p for host, p, proc in rows if host == node_ip and ("DashboardA" in proc or "RuntimeEnv" in proc)}
    assert agents
    for port in agents:
        assert http_status(f"http://{node_ip}:{port}/api/jobs/") in (401, 403), port
