"""``rayjobs doctor``: is this Ray cluster ready for a run? One probe per node, then a table.

Checks: the nodes and their resources; the run's workers against them; devices alike within each
node type; Ray, torch, MLflow, rayjobs and Python versions alike on every node; ``run.storage_path``
writable on the driver and readable and writable from every node (so it is shared); the MLflow
server reachable from the nodes; the working directory small enough for ``ray job submit``; Ray's
token auth on. A FAIL is blocking (exit status 1); a warn is not.
"""

from __future__ import annotations

import os
import platform
import secrets
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayjobs.storage.bucket import RunStore, StoreError
from rayjobs.storage.uri import is_uri

OK, WARN, FAIL = "ok", "warn", "FAIL"
PROBE_DIR = ".rayjobs-doctor"


@dataclass
class Check:
    """One line of the doctor's table."""

    name: str
    status: str
    detail: str


def _write_probe(storage: str, name: str, text: str) -> str:
    """Write one probe file under the storage path or into the bucket; '' or what went wrong."""
    try:
        if is_uri(storage):
            RunStore(storage, PROBE_DIR).write_bytes(name, text.encode())
        else:
            Path(storage, PROBE_DIR).mkdir(parents=True, exist_ok=True)
            Path(storage, PROBE_DIR, name).write_text(text)
    except (OSError, StoreError) as exc:
        return f"cannot write {_probe_place(storage, name)} ({getattr(exc, 'strerror', None) or exc})"
    return ""


def _read_probe(storage: str, name: str) -> str | None:
    """A probe file's text, or None when it cannot be read."""
    try:
        if is_uri(storage):
            raw = RunStore(storage, PROBE_DIR).read_bytes(name)
            return raw.decode() if raw is not None else None
        return Path(storage, PROBE_DIR, name).read_text()
    except (OSError, StoreError):
        return None


def _probe_place(storage: str, name: str) -> str:
    return RunStore(storage, PROBE_DIR).url(name) if is_uri(storage) else str(Path(storage, PROBE_DIR, name))


def probe(storage_dir: str, nonce: str, tracking_uri: str) -> dict[str, Any]:
    """What one node reports: who it is, its versions and devices, what it sees of storage and MLflow."""
    import mlflow
    import ray
    import torch

    import rayjobs
    from rayjobs.devices import describe

    ctx = ray.get_runtime_context()
    devices = [describe(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
    out: dict[str, Any] = {
        "node_id": ctx.get_node_id(),
        "ip": ray.util.get_node_ip_address(),
        "node_type": os.environ.get("RAY_NODE_TYPE_NAME", ""),
        "versions": versions(mlflow, ray, torch, rayjobs),
        "devices": devices or [describe(torch.device("cpu"))],
    }
    seen = _read_probe(storage_dir, "driver")
    marker = _probe_place(storage_dir, "driver")
    if seen is None:
        out["storage"] = f"cannot read {marker}"
    else:
        out["storage"] = "" if seen == nonce else f"{marker} holds another driver's mark"
    if not out["storage"]:
        out["storage"] = _write_probe(storage_dir, f"node-{out['node_id'][:12]}", nonce)
    out["mlflow"] = reach_mlflow(tracking_uri)
    return out


def versions(mlflow: Any, ray: Any, torch: Any, rayjobs: Any) -> dict[str, str]:
    """The versions that must match across nodes."""
    return {
        "python": platform.python_version(),
        "ray": ray.__version__,
        "torch": torch.__version__,
        "mlflow": mlflow.__version__,
        "rayjobs": getattr(rayjobs, "__version__", "?"),
    }


def reach_mlflow(uri: str) -> str:
    """'' when the tracking server answers its health check (or the URI is a file store); else why not."""
    if not uri.startswith(("http://", "https://")):
        return ""
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5) as resp:
            return "" if resp.status == 200 else f"HTTP {resp.status}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{uri} unreachable ({getattr(exc, 'reason', exc)})"


def run_checks(
    storage_path: str, tracking_uri: str, working_dir: str, dashboard_url: str = "", scaling: Check | None = None
) -> list[Check]:
    """Probe every alive node of the connected cluster and return the table's rows (``scaling``: the
    run's workers, checked by ``scaling_check``, as the second row)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    res = [n.get("Resources", {}) for n in nodes]
    cpus, gpus = sum(r.get("CPU", 0) for r in res), sum(r.get("GPU", 0) for r in res)
    checks = [Check("nodes", OK, f"{len(nodes)} alive; CPU {cpus:g}, GPU {gpus:g}")]
    if scaling is not None:
        checks.append(scaling)
    storage = storage_path if is_uri(storage_path) else os.path.abspath(os.path.expanduser(storage_path))
    nonce = secrets.token_hex(8)
    problem = _write_probe(storage, "driver", nonce)
    if problem:
        checks.append(Check("storage", FAIL, f"run.storage_path {storage}: the driver {problem}"))
        return checks
    reports = probe_nodes(nodes, storage, nonce, tracking_uri)
    checks += device_checks(reports)
    checks.append(version_check(reports))
    checks.append(storage_check(reports, storage, nonce))
    checks.append(mlflow_check(reports, tracking_uri))
    checks.append(working_dir_check(working_dir))
    checks.append(token_check(dashboard_url))
    return checks


def scaling_check(cfg: Any, local: bool) -> Check:
    """The run's workers: the checks a run makes before Ray (FAIL), then where they go. ``local`` (no
    RAY_ADDRESS; called before Ray starts): a local Ray declares the CPUs they need, and warns where
    that is over twice this machine's. On a cluster: whether it holds them now (warn: the run waits
    for nodes to join)."""
    import ray

    from rayjobs import launch
    from rayjobs.errors import ConfigError

    if cfg.scaling.num_workers == 0:
        return Check("scaling", OK, "local mode (scaling.num_workers=0): the run trains in the driver, no Ray workers")
    have = {} if local else ray.cluster_resources()
    gpus = launch.local_gpu_count() if local else int(have.get("GPU", 0))
    try:
        plan = launch.plan_scaling(cfg, gpus)
    except ConfigError as exc:
        return Check("scaling", FAIL, exc.problems[0])
    per = {"CPU": 1.0, **({"GPU": 1.0} if plan.use_gpu else {}), **plan.resources_per_worker}
    need_cpu, need_gpu = per["CPU"] * plan.num_workers, per.get("GPU", 0.0) * plan.num_workers
    asked = f"{plan.num_workers} worker(s) x {', '.join(f'{k} {v:g}' for k, v in per.items())}"
    if local:
        crowded = launch.oversubscription(need_cpu, os.cpu_count() or 1)
        if crowded:
            return Check("scaling", WARN, crowded)
        return Check("scaling", OK, f"{asked} on a local Ray of {launch.local_ray_cpus(need_cpu)} CPU(s)")
    cpus, gpus_now = have.get("CPU", 0.0), have.get("GPU", 0.0)
    if need_cpu > cpus or need_gpu > gpus_now:
        return Check(
            "scaling",
            WARN,
            f"{asked} need CPU {need_cpu:g}, GPU {need_gpu:g}; the cluster has CPU {cpus:g}, GPU {gpus_now:g} now: "
            "the run waits for nodes to join (an autoscaler adds them), else lower scaling.num_workers",
        )
    return Check("scaling", OK, f"{asked}: CPU {need_cpu:g} of {cpus:g}, GPU {need_gpu:g} of {gpus_now:g}")


def probe_nodes(nodes: list[dict[str, Any]], storage: str, nonce: str, tracking_uri: str) -> list[dict[str, Any]]:
    """Run ``probe`` on every node (pinned to it) and return the reports, each with its node type."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0)(probe)
    refs = [
        remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            storage, nonce, tracking_uri
        )
        for n in nodes
    ]
    reports = ray.get(refs, timeout=300)
    for report, node in zip(reports, nodes, strict=True):
        report["node_type"] = report["node_type"] or (
            "head" if node.get("Resources", {}).get("node:__internal_head__") else "worker"
        )
    return reports


def device_checks(reports: list[dict[str, Any]]) -> list[Check]:
    """One row per node type: its nodes' devices are alike."""
    from rayjobs import devices as devs

    by_type: dict[str, list[dict[str, Any]]] = {}
    for r in reports:
        by_type.setdefault(r["node_type"], []).append(r)
    checks = []
    for node_type, group in sorted(by_type.items()):
        devices = [d for r in group for d in r["devices"]]
        unlike = devs.differences(devices)
        first = devices[0]
        detail = (
            unlike[0] if unlike else f"{len(group)} node(s), {len(devices)} x {first['name']} ({first['capability']})"
        )
        checks.append(Check(f"devices ({node_type})", FAIL if unlike else OK, detail))
    return checks


def version_check(reports: list[dict[str, Any]]) -> Check:
    """Every node runs the driver's versions of mlflow, ray, torch and rayjobs."""
    import mlflow
    import ray
    import torch

    import rayjobs

    mine = versions(mlflow, ray, torch, rayjobs)
    differ = [
        f"node {r['ip']} has {k} {r['versions'][k]}, the driver {v}"
        for r in reports
        for k, v in mine.items()
        if r["versions"].get(k) != v
    ]
    return Check(
        "versions", FAIL if differ else OK, differ[0] if differ else " ".join(f"{k} {v}" for k, v in mine.items())
    )


def storage_check(reports: list[dict[str, Any]], storage: str, nonce: str) -> Check:
    """Every node reads the driver's probe and writes its own, which the driver reads back."""
    blind = [(r, r["storage"]) for r in reports if r["storage"]]
    if blind:
        r, why = blind[0]
        fix = (
            "give every node the bucket's credentials (role or runtime_env env_vars) and network access"
            if is_uri(storage)
            else "put it on a filesystem every node mounts (NFS, EFS, a ReadWriteMany PVC) at the same path"
        )
        return Check("storage", FAIL, f"run.storage_path {storage} is not shared: node {r['ip']} {why}; {fix}")
    back = [r for r in reports if _read_probe(storage, f"node-{r['node_id'][:12]}") != nonce]
    detail = (
        f"the driver cannot see what node {back[0]['ip']} wrote under {storage}"
        if back
        else f"{storage} written by the driver, read and written by {len(reports)} node(s)"
    )
    return Check("storage", FAIL if back else OK, detail)


def mlflow_check(reports: list[dict[str, Any]], tracking_uri: str) -> Check:
    """A tracking server answers from every node (a file store needs no network)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return Check("mlflow", OK, f"{tracking_uri or 'sqlite under run.storage_path'} (file store)")
    lost = [r for r in reports if r["mlflow"]]
    detail = f"from node {lost[0]['ip']}: {lost[0]['mlflow']}" if lost else f"{tracking_uri} answers from every node"
    return Check("mlflow", FAIL if lost else OK, detail)


def working_dir_check(working_dir: str) -> Check:
    """The zip ``ray job submit --working-dir`` would upload, against Ray's size limit."""
    from ray._private.runtime_env import packaging

    root = Path(working_dir).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "pkg.zip")
        packaging.create_package(str(root), out, include_gitignore=True, excludes=[".git"], logger=None)
        size = out.stat().st_size
    limit = packaging.GCS_STORAGE_MAX_SIZE
    mib = size / 2**20
    if size >= limit:
        return Check(
            "working_dir",
            FAIL,
            f"{root} zips to {mib:.1f} MiB, over Ray's {limit / 2**20:.0f} MiB limit: add to .gitignore",
        )
    status = WARN if size >= packaging.PACKAGE_SIZE_WARNING else OK
    return Check(
        "working_dir", status, f"{root} zips to {mib:.1f} MiB (limit {limit / 2**20:.0f} MiB; .gitignore honoured)"
    )


def token_check(dashboard_url: str = "") -> Check:
    """Ray's token auth: on for this client, and enforced: the Jobs API refuses a request without the token."""
    mode = os.environ.get("RAY_AUTH_MODE", "")
    from rayjobs.launch import auth_token_available

    has_token = auth_token_available()
    if mode == "disabled":
        return Check(
            "token auth", FAIL, "RAY_AUTH_MODE=disabled: anyone who reaches Ray's ports can run code; unset it"
        )
    if not has_token:
        return Check("token auth", WARN, "no token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token")
    if not dashboard_url:
        return Check("token auth", OK, "on (the client has a token; no dashboard to ask)")
    url = f"{dashboard_url if '://' in dashboard_url else 'http://' + dashboard_url}/api/jobs/"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            status = resp.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:
        return Check("token auth", WARN, f"the client has a token, but {url} did not answer ({exc})")
    if status in (401, 403):
        return Check("token auth", OK, f"on: {url} refuses a request without the token ({status})")
    return Check(
        "token auth",
        FAIL,
        f"{url} answers a request without a token ({status}): start the cluster with RAY_AUTH_MODE=token",
    )


def table(checks: list[Check]) -> str:
    """The checks as an aligned text table."""
    width = max(len(c.name) for c in checks)
    return "\n".join(f"{c.name:<{width}}  {c.status:<4}  {c.detail}" for c in checks)


def main(storage_path: str, tracking_uri: str, working_dir: str, summary: str | None = None, cfg: Any = None) -> int:
    """Connect to the cluster in RAY_ADDRESS (else a local one), print the table; 1 when something blocks.

    ``summary``: also write the checks as JSON there (``[{name, status, detail}, ...]``); ``cfg``: the
    run config whose workers are checked against the cluster.
    """
    import logging

    logging.getLogger("ray").setLevel(logging.WARNING)
    local = not os.environ.get("RAY_ADDRESS")  # as a run decides: without it, a local Ray of the run's own
    scaling = scaling_check(cfg, local=True) if cfg is not None and local else None
    if not local:
        from rayjobs.launch import connect_cluster

        ctx = connect_cluster(log_to_driver=False, logging_level=logging.WARNING)
    else:  # the local Ray a run would start (ray.init() joined a `ray start` cluster here, or took port 8265)
        from rayjobs.launch import start_local_ray

        ctx = start_local_ray(os.cpu_count() or 1, log_to_driver=False, logging_level=logging.WARNING)
    import ray

    try:
        if cfg is not None and not local:
            scaling = scaling_check(cfg, local=False)
        checks = run_checks(storage_path, tracking_uri, working_dir, getattr(ctx, "dashboard_url", "") or "", scaling)
    finally:
        ray.shutdown()
    print(table(checks))
    if summary:
        import dataclasses
        import json

        os.makedirs(os.path.dirname(os.path.abspath(summary)), exist_ok=True)
        with open(summary, "w") as f:
            json.dump({"checks": [dataclasses.asdict(c) for c in checks]}, f, indent=2)
    failed = [c for c in checks if c.status == FAIL]
    if failed:
        print(
            f"rayjobs doctor: {len(failed)} blocking problem(s): {failed[0].name}: {failed[0].detail}", file=sys.stderr
        )
        return 1
    print(f"rayjobs doctor: all {len(checks)} checks passed")
    return 0
