"""The scaling plan and ``ray.init``, shared by the train and tune drivers.

``plan_scaling`` resolves ``auto`` into a ``ScalingPlan`` and checks it against the config (one
line per problem, before Ray starts); ``init_ray`` connects to ``RAY_ADDRESS`` or starts a local
Ray sized for the plan.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import tempfile
from typing import Any

from rayjobs import log, parallel
from rayjobs.config import RunConfig
from rayjobs.errors import ConfigError
from rayjobs.plan import ScalingPlan


def existing_cluster() -> bool:
    """True when this driver runs against a cluster (RAY_ADDRESS, or Ray already initialized)."""
    return bool(os.environ.get("RAY_ADDRESS")) or ray_initialized()


def ray_initialized() -> bool:
    """Whether this process is connected to a Ray (without importing Ray to ask)."""
    ray = sys.modules.get("ray")  # never import Ray just to ask: bad input must not start it
    return bool(ray is not None and ray.is_initialized())


def connect_cluster(**init_kwargs: Any) -> Any:
    """``ray.init`` on the cluster in RAY_ADDRESS (returns its context). An address where no cluster
    answers is one line at once: Ray itself retries it for minutes, or raises a traceback."""
    address = os.environ["RAY_ADDRESS"]
    check_ray_address(address)
    # A `ray start` cluster turns token auth on when a token exists, but a driver sends its token
    # only in token mode (without it Ray retries for 20 s, then "Failed to connect"); a cluster
    # without auth accepts a token too.
    if not os.environ.get("RAY_AUTH_MODE") and auth_token_available():
        os.environ["RAY_AUTH_MODE"] = "token"
    import ray

    try:
        return ray.init(address=address, **init_kwargs)
    except ConnectionError as exc:  # "auto" with no cluster on this machine, a GCS that went away, a wrong token
        raise ConfigError(
            f"RAY_ADDRESS={address}: {str(exc).splitlines()[0].rstrip('.')}; start the cluster (`rayjobs cluster up`, "
            "`ray start --head`), give its token (RAY_AUTH_TOKEN) if it has one, or unset RAY_ADDRESS to run on a "
            "local Ray"
        ) from None


def auth_token_available() -> bool:
    """Whether this driver has a Ray auth token: RAY_AUTH_TOKEN(_PATH), or Ray's default file."""
    from rayjobs.cluster import TOKEN_FILE

    return bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or TOKEN_FILE.is_file())


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """RAY_ADDRESS must be a cluster's GCS address (host:port, or ray://host:port) that accepts a connection."""
    if address.startswith(("http://", "https://")):
        raise ConfigError(
            f"RAY_ADDRESS={address} is an HTTP address (the dashboard's, for `ray job submit --address`); "
            "a driver connects to the cluster's GCS: RAY_ADDRESS=HOST:6379, or unset it to run on a local Ray"
        )
    if address in ("auto", "local"):
        return  # Ray looks on this machine (a ConnectionError when there is nothing)
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"RAY_ADDRESS={address}: expected HOST:PORT, e.g. 127.0.0.1:6379")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(
            f"RAY_ADDRESS={address}: no Ray cluster answers there ({exc.strerror or exc}); start it "
            "(`rayjobs cluster up`, `ray start --head`) or unset RAY_ADDRESS to run on a local Ray"
        ) from None


def local_gpu_count() -> int:
    """GPUs visible to this process (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cluster_gpu_count() -> int:
    """GPUs in the cluster this driver will use (the running cluster's, else this machine's)."""
    if existing_cluster():
        if not ray_initialized():
            connect_cluster(log_to_driver=True)
        import ray

        return int(ray.cluster_resources().get("GPU", 0))
    return local_gpu_count()


def plan_scaling(cfg: RunConfig, gpus_available: int) -> ScalingPlan:
    """Resolve ``auto`` values and check the plan against the config; ConfigError when they clash."""
    s = cfg.scaling
    use_gpu = gpus_available > 0 if s.use_gpu == "auto" else bool(s.use_gpu)
    max_workers = 0
    if s.num_workers == "auto":
        num_workers = gpus_available if use_gpu and gpus_available else 2
    elif isinstance(s.num_workers, list):
        num_workers, max_workers = s.num_workers
    else:
        num_workers = s.num_workers
    plan = ScalingPlan(num_workers, use_gpu, dict(s.resources_per_worker) or {"CPU": 1.0}, max_workers)
    problems = parallel.layout_problems(cfg, plan.world_size, use_gpu)
    if max_workers:
        problems += elastic_problems(cfg, num_workers, max_workers)
    problems += _batch_problems(cfg, plan, layout_ok=not problems)
    if cfg.training.precision == "fp16" and not use_gpu:
        problems.append("training.precision: fp16 needs a GPU; use bf16 or fp32 on CPU, got 'fp16'")
    if s.accelerator_type and not use_gpu:
        problems.append(
            f"scaling.accelerator_type={s.accelerator_type} pins GPU workers, but this run uses no GPU; "
            "set scaling.use_gpu=true, or leave accelerator_type empty"
        )
    if use_gpu and s.use_gpu is True and gpus_available == 0 and not existing_cluster():
        problems.append("scaling.use_gpu: true, but this machine has no GPU; set it to auto or false")
    problems += resource_problems(plan, gpus_available, local=not existing_cluster())
    f = cfg.faults
    for name, rank in (("faults.kill_rank", f.kill_rank), ("faults.nan_rank", f.nan_rank)):
        if rank >= plan.world_size:
            problems.append(f"{name}: must be a rank below the world size {plan.world_size}, got {rank}")
    if problems:
        raise ConfigError(problems)
    return plan


RAY_RESOURCES = ("CPU", "GPU", "memory")  # what a local Ray declares (besides its own node: labels)


def resource_problems(plan: ScalingPlan, gpus_available: int, local: bool) -> list[str]:
    """``scaling.resources_per_worker`` that Ray would refuse, or wait on for ever: a misspelled
    resource, GPUs against ``use_gpu``, and on a local Ray what this machine does not have."""
    problems = []
    asked = plan.resources_per_worker
    for key in asked:
        canonical = next((r for r in RAY_RESOURCES if r.lower() == key.lower()), None)
        if canonical and canonical != key:
            problems.append(f"scaling.resources_per_worker.{key}: Ray's resource is {canonical!r}; write {canonical}")
        elif canonical is None and local:
            problems.append(
                f"scaling.resources_per_worker.{key}: a local Ray has no resource {key!r} (only "
                f"{', '.join(RAY_RESOURCES)}), so the run would wait for it for ever; remove it, or run on a "
                "cluster whose nodes declare it"
            )
    gpus = asked.get("GPU", 1.0 if plan.use_gpu else 0.0)
    if gpus > 0 and not plan.use_gpu:
        problems.append(
            "scaling.resources_per_worker.GPU: this run uses no GPU; set scaling.use_gpu=true, or remove GPU"
        )
    elif plan.use_gpu and gpus == 0:
        problems.append(
            "scaling.resources_per_worker.GPU: 0 with GPU workers; give it e.g. 1, or set scaling.use_gpu=false"
        )
    elif local and plan.use_gpu and gpus_available and gpus * plan.num_workers > gpus_available:  # 0: said above
        problems.append(
            f"scaling.resources_per_worker.GPU: {plan.num_workers} worker(s) x {gpus:g} GPU need "
            f"{gpus * plan.num_workers:g} GPU(s), and this machine has {gpus_available}; lower scaling.num_workers "
            "or the GPUs per worker"
        )
    return problems


def check_local_resources(plan: ScalingPlan) -> None:
    """ConfigError where the local Ray just started cannot hold the workers (a run would wait for ever)."""
    import ray

    have = ray.cluster_resources()
    for key, amount in plan.resources_per_worker.items():
        need = amount * plan.num_workers
        if key in RAY_RESOURCES and key != "CPU" and need > have.get(key, 0.0):
            unit = 2**30 if key == "memory" else 1
            raise ConfigError(
                f"scaling.resources_per_worker.{key}: {plan.num_workers} worker(s) need {need / unit:g}"
                f"{' GiB' if unit > 1 else ''} in all, and this machine's Ray has {have.get(key, 0.0) / unit:.3g}"
                f"{' GiB' if unit > 1 else ''}: the run would wait for ever; lower it or scaling.num_workers"
            )


def _batch_problems(cfg: RunConfig, plan: ScalingPlan, layout_ok: bool) -> list[str]:
    """The global batch must split evenly over the data-parallel replicas and the accumulation steps."""
    replicas = parallel.resolve_layout(cfg.parallel, plan.world_size).dp if layout_ok else plan.world_size
    parts = replicas * cfg.training.grad_accum
    if cfg.training.batch_size % parts == 0:
        return []
    who = "workers" if replicas == plan.world_size else "data-parallel replicas"
    return [
        f"training.batch_size: must be a multiple of {who} ({replicas}) x grad_accum "
        f"({cfg.training.grad_accum}) = {parts}, got {cfg.training.batch_size}"
    ]


def elastic_problems(cfg: RunConfig, low: int, high: int) -> list[str]:
    """An elastic run changes its world size: only layouts that allow it, and a batch every size divides."""
    problems = []
    degrees = [k for k in parallel.DEGREES if getattr(cfg.parallel, k)]
    if not parallel.strategy(cfg.parallel.strategy).elastic or degrees:
        fixed = f"parallel.{degrees[0]} fixed" if degrees else f"parallel.strategy {cfg.parallel.strategy}"
        problems.append(
            f"scaling.num_workers=[{low}, {high}] (elastic) needs parallel.strategy "
            f"{' or '.join(parallel.elastic_strategies())} with derived degrees, got {fixed}; "
            "give a fixed number of workers for other layouts"
        )
    bad = [w for w in range(low, high + 1) if cfg.training.batch_size % (w * cfg.training.grad_accum)]
    if bad:
        problems.append(
            f"training.batch_size: an elastic run keeps the global batch at every size from {low} to {high} "
            f"workers, but {cfg.training.batch_size} does not divide over {bad[0]} x grad_accum "
            f"{cfg.training.grad_accum}; pick a multiple of each"
        )
    if cfg.failure.max_failures == 0:
        problems.append(
            "failure.max_failures: an elastic run restarts its worker group when a node leaves; set it above 0 (or -1)"
        )
    return problems


def init_ray(plan: ScalingPlan, streaming: bool = False, driver_cpus: float = 0.0) -> None:
    """Connect to the cluster in RAY_ADDRESS, or start a local Ray sized for the plan.

    A streamed dataset (Ray Data) needs CPUs beside the training workers for its read and
    ``map_batches`` tasks: a local Ray gets one more; on a running cluster a warning says so.
    ``driver_cpus`` is what a driver actor reserves beside its workers (a Tune trial's).
    """
    cpus_needed = plan.num_workers * plan.cpus_per_worker + driver_cpus
    if existing_cluster():
        if not ray_initialized():
            connect_cluster(log_to_driver=True)
        import ray

        cluster_cpus = ray.cluster_resources().get("CPU", 0.0)
        if cluster_cpus < cpus_needed:
            log.alert(
                f"this run takes {cpus_needed:g} CPU(s) and the cluster has {cluster_cpus:g} now: it waits for an "
                "autoscaled node; lower scaling.num_workers or scaling.resources_per_worker.CPU to start now"
            )
        elif streaming and cluster_cpus - cpus_needed < 1:
            log.alert(
                f"Ray Data reads on CPUs beside the training workers, and this cluster has {cluster_cpus:g} "
                f"CPU(s) with {cpus_needed:g} taken by the workers: reading waits for an autoscaled node; "
                "lower scaling.resources_per_worker.CPU (e.g. 0.5) to leave it one"
            )
        return
    cpus_needed += 1 if streaming else 0
    # The driver's directory on the workers' path, so a user's `pkg.module:callable` model imports.
    path = os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p)
    # Starting a worker group takes long on a loaded small machine (several trials at once):
    # Ray's 60 s default turns that into restart loops.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "300")
    crowded = oversubscription(cpus_needed, os.cpu_count() or 1)
    if crowded:
        log.alert(crowded)
    start_local_ray(
        num_cpus=local_ray_cpus(cpus_needed),
        env_vars={
            "PYTHONPATH": path,
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"],
        },
        log_to_driver=True,
    )
    check_local_resources(plan)


def oversubscription(cpus_needed: float, cpus: int) -> str:
    """The warning for a local run that reserves over twice this machine's CPUs ('' when it does not): a
    local Ray declares as many as the run needs, so it starts, but slowly (64 workers on 2 CPUs had
    not taken a step after 5 minutes)."""
    if cpus_needed <= 2 * cpus:
        return ""
    return (
        f"this run reserves {cpus_needed:g} CPUs and this machine has {cpus}: its workers share them (about "
        f"{cpus / cpus_needed:.2g} CPU each) and start slowly; lower scaling.num_workers, or run on a cluster (RAY_ADDRESS)"
    )


def local_ray_cpus(cpus_needed: float) -> int:
    """CPUs a local Ray declares: this machine's, or more where one run needs more (oversubscribed)."""
    return max(os.cpu_count() or 1, math.ceil(cpus_needed - 1e-9))


GCS_PORT_VARIABLE = "RAY_GCS_SERVER_PORT"  # ray.init reads it as it starts a head's GCS
PREEMPTION_WATCHER_VARIABLE = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"  # read by the Train controller
REPORT_POLL_VARIABLE = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"  # read by the Train controller (default 2 s)
REPORT_POLL_S = "0.25"
PRESTART_VARIABLE = "RAY_prestart_worker_first_driver"  # read by the raylet as it starts

_own_gcs_port = ""  # the GCS port of the local Ray this process started, which ends with it


def owns_local_ray() -> bool:
    """Whether this process is connected to a local Ray it started itself (one that ends with this
    process), not to a cluster or to the Ray a Tune trial runs in."""
    if not (_own_gcs_port and ray_initialized()):
        return False
    import ray

    return ray.get_runtime_context().gcs_address.rpartition(":")[2] == _own_gcs_port


def poll_reports_often() -> None:
    """Have the Train controller take the workers' reports every 0.25 s instead of every 2 s.

    A worker's ``ray.train.report`` waits until the controller has taken its previous report, and
    the controller takes them when it polls the workers. At Ray's default a run that reports more
    often than every 2 s (the default job reports every 0.25 s of training) spent most of its time
    waiting: 54 s for the default job, 27 s with this. Ray passes the driver's value on to the
    controller it starts, on a local Ray and on a cluster alike; a value the user set is kept, and
    one that is not a positive number of seconds is refused here (Ray's controller dies on it).
    """
    value = os.environ.setdefault(REPORT_POLL_VARIABLE, REPORT_POLL_S)
    try:
        ok = float(value) > 0
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(
            f"{REPORT_POLL_VARIABLE}={value!r} is not a positive number of seconds; "
            f"unset it (rayjobs polls every {REPORT_POLL_S} s) or set e.g. 0.5"
        )


def start_local_ray(num_cpus: int, env_vars: dict[str, str] | None = None, **init_kwargs: Any) -> Any:
    """Start a new local Ray of this process's own, whose processes all know it is theirs (returns
    ``ray.init``'s context).

    Its GCS and dashboard take free ports, never the well-known 6379 and 8265 of a `ray start` cluster.
    Even where another Ray runs on this machine (a `ray start` cluster, another user's run): Ray
    Train's placement-group cleaner (a detached actor) finds its cluster through Ray's state API,
    which without ``RAY_ADDRESS`` picks the newest `ray start` cluster, or fails outright when
    several run. Then a trial that ASHA stopped left its workers' placement group held for good,
    and the cleaner printed a warning every second. So the GCS port is chosen before the start,
    and every worker gets ``RAY_ADDRESS`` pointing at it.
    """
    import ray

    check_ray_tmpdir()
    port = _free_port()
    env = {**(env_vars or {}), "RAY_ADDRESS": f"127.0.0.1:{port}"}
    # Ray Train watches for node drains (spot preemption) with an actor per run; a local Ray's one
    # node is this machine, which no autoscaler drains. The actor costs a process start, and Ray
    # prints an error-level line about its restart policy on every run.
    env.setdefault(PREEMPTION_WATCHER_VARIABLE, os.environ.get(PREEMPTION_WATCHER_VARIABLE, "0"))
    # Read by the processes ray.init starts: the GCS port, and no workers started ahead of need for
    # the first driver: they have no runtime_env, this job has one, so none was ever used, and on
    # 2 cores their start slowed Ray's own (a value you set is kept).
    starting = {GCS_PORT_VARIABLE: str(port), PRESTART_VARIABLE: os.environ.get(PRESTART_VARIABLE, "0")}
    previous = {name: os.environ.get(name) for name in starting}
    os.environ.update(starting)
    if init_kwargs.get("include_dashboard") is not False:
        # Not Ray's 8265 either: that is the port `rayjobs cluster up` and `ray start --head` give their
        # dashboard and Jobs API, and one a local run held refused them (Ray prints this one's address).
        init_kwargs.setdefault("dashboard_port", _free_port())
    try:
        context = ray.init(address="local", num_cpus=num_cpus, runtime_env={"env_vars": env}, **init_kwargs)
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    global _own_gcs_port
    _own_gcs_port = str(port)
    return context


def check_ray_tmpdir() -> None:
    """A ``RAY_TMPDIR`` where a local Ray cannot make its session directory is named by its variable
    (Ray's own error named only the path, which the user may not know came from there)."""
    path = os.environ.get("RAY_TMPDIR")
    if not path:
        return
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # a real write: as root, os.access says yes to /proc
            pass
    except OSError as exc:
        raise ConfigError(
            f"RAY_TMPDIR={path}: {exc.strerror or exc}; unset it or point it at a directory you can write to"
        ) from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
