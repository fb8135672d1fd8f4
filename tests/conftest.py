"""Shared fixtures: environment restored after each test, process groups torn down, one Ray per module.

Tests live in tiers by folder (each test is marked with its tier): ``unit`` (no processes but the
CLI's), ``dist`` (multi-process gloo, local mode, real MLflow and S3 servers), ``ray`` (a local Ray
cluster, ``ray start --head``, ``ray job submit``), ``cluster`` (the autoscaling cluster), and
``test_readme.py`` (every README command as written).
"""

from __future__ import annotations

import os
import re
import socket
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = str(Path(sys.executable).parent)


@pytest.fixture(autouse=True)
def _restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


TIERS = ("unit", "dist", "ray", "cluster")

# gpt's debug flavor (width 32) on synthetic tokens, and what preflight says when 3 heads are asked of it.
GPT_DEBUG_ON_TOKENS = ["model.name=gpt", "model.flavor=debug", "data.name=synthetic", "data.kwargs.kind=tokens"]
THREE_HEADS_CANNOT_BUILD = (
    "model.kwargs: gpt (flavor debug, {'n_heads': 3}) cannot be built for inputs (128,) of data.name=synthetic: "
    "ValueError: dim (32) must be divisible by n_heads (3)"
)


# Under pytest-xdist (`make test-fast` runs `-n 2 --dist loadfile`) a module is one unit of work, so its
# module-scoped Ray, `ray start --head` or MLflow server is started once, and the README's commands
# run in order in one directory. Modules are handed out longest first, so that a long one does not
# start last while the other worker idles: by the seconds their selected tests took when they last ran
# (pytest's cache), else by tier (the README, the autoscaling cluster, the Ray tier, then the quick
# tiers by their number of tests). Handed out in tier order, the quick tiers ended 198 s and 156 s into
# the run on their two workers; longest first, 177 s and 178 s.
_FIRST = ("test_readme.py", "cluster", "ray")
TEST_SECONDS = "rayjobs/test_seconds"
_ran_seconds: dict[str, float] = {}


def _tier(item) -> str:
    return Path(str(item.fspath)).parent.name


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _hand_out_order(items, seconds: dict[str, float]) -> list:
    """``items`` with their modules longest first (stable within a module)."""
    weight: dict[str, float] = {}
    if all(item.nodeid in seconds for item in items):
        for item in items:
            weight[_module(item.nodeid)] = weight.get(_module(item.nodeid), 0.0) + seconds[item.nodeid]
    else:
        for item in items:
            path = Path(_module(item.nodeid))
            name = path.name if path.name == "test_readme.py" else path.parent.name
            tier_first = 1e6 * (len(_FIRST) - _FIRST.index(name)) if name in _FIRST else 0.0
            weight[_module(item.nodeid)] = weight.get(_module(item.nodeid), tier_first) + 1
    return sorted(items, key=lambda item: -weight[_module(item.nodeid)])


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier (the folder it lives in): ``-m unit``, ``-m "unit or dist"``, ...;
    under pytest-xdist, hand the modules out longest first."""
    for item in items:
        tier = _tier(item)
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    if hasattr(config, "workerinput"):  # a worker: its order is the hand-out order
        items[:] = _hand_out_order(items, cache.get(TEST_SECONDS, {}) if cache else {})


def pytest_runtest_logreport(report):
    """Add up each test's seconds (setup, call and teardown), for the next run's hand-out order."""
    _ran_seconds[report.nodeid] = _ran_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    config = session.config
    cache = getattr(config, "cache", None)
    if hasattr(config, "workerinput") or cache is None or not _ran_seconds:
        return  # a worker's reports reach the controller, which keeps the times
    cache.set(TEST_SECONDS, {**cache.get(TEST_SECONDS, {}), **_ran_seconds})


# The credentials a cluster's processes get from the environment they were started in (a node's role).
_NODE_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_")
_shared_ray: dict[str, object] = {"env": None}


def _node_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_NODE_ENV_PREFIXES)}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray (2 CPUs) shared by the tests of a module (one already up with the same node
    environment, i.e. bucket credentials, is reused; ``_no_ray_outlives_its_module`` ends it)."""
    import ray

    if ray.is_initialized() and _shared_ray["env"] == _node_env():
        yield ray
        return
    if ray.is_initialized():
        ray.shutdown()
    from rayjobs.launch import start_local_ray

    start_local_ray(  # never a `ray start` cluster another test left running
        num_cpus=2,
        env_vars={"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
        include_dashboard=True,
        log_to_driver=True,
    )
    _shared_ray["env"] = _node_env()
    yield ray


@pytest.fixture(scope="module", autouse=True)
def _no_ray_outlives_its_module():
    """The in-process Ray goes with its module: another Ray beside it (`ray start --head`, a CLI run, a
    README command) would collide on Ray's fixed ports (the dashboard agent's 52365)."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs the CLI, then reports on stdout whether `ray` was ever imported (no import: no Ray process), and
# `torch` (1-2 s of a command's start).
CLI_PROBE = (
    "import sys, atexit\n"
    "atexit.register(lambda: print(f\"TORCH_IMPORTED={'torch' in sys.modules}\\nRAY_IMPORTED={'ray' in sys.modules}\"))\n"
    "from rayjobs.cli import main\n"
    "main(sys.argv[1:])\n"
)


def run_cli(*args: str, timeout: float = 60, cwd: Path | str | None = None, env: dict[str, str] | None = None):
    """``rayjobs ARGS`` in a subprocess; its stdout ends with ``TORCH_IMPORTED=True|False``, then ``RAY_IMPORTED=...``.

    It runs in a fresh directory of its own (a user's, not the repo: the default `results/` of two
    tests running at once must not be one run directory), or in ``cwd``; ``env`` adds variables."""
    import subprocess
    import tempfile

    own_dir = tempfile.mkdtemp(prefix="rayjobs-cli-") if cwd is None else None
    try:
        return subprocess.run(
            [sys.executable, "-c", CLI_PROBE, *args],
            cwd=cwd or own_dir,
            env=subprocess_env(**(env or {})),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        if own_dir:
            import shutil

            shutil.rmtree(own_dir, ignore_errors=True)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess: the venv first on PATH, the repo and tests importable."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([VENV_BIN, env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests")])
    env.update(extra)
    return env


class RayHead:
    """A real `ray start --head` on 127.0.0.1 with token auth on, started and stopped by a test."""

    def __init__(self, tmp_root: Path, num_cpus: int = 2) -> None:
        import secrets
        import tempfile

        # Ray's socket paths must stay short: a temp dir directly under /tmp.
        self.temp_dir = tempfile.mkdtemp(prefix="rjh-", dir="/tmp")
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.token = secrets.token_hex(16)
        self.num_cpus = num_cpus
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.env = subprocess_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)

    def start(self) -> None:
        import subprocess

        cmd = [
            f"{VENV_BIN}/ray",
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={self.gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            "--dashboard-agent-listen-port=0",  # not Ray's fixed 52365: a Ray beside it (another test) may hold it
            f"--num-cpus={self.num_cpus}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]
        try:
            subprocess.run(cmd, env=self.env, check=True, capture_output=True, text=True, timeout=120)
            self.wait_until_jobs_are_accepted()
        except Exception:
            self.stop()  # a head that never got ready must not outlive the test (it confuses later Rays)
            raise

    def wait_until_jobs_are_accepted(self, timeout: float = 120.0) -> None:
        """`ray start` returns before the head's job agent registers; the Jobs API then answers
        "No available agent to submit job, please try again later" (after 10 s) on a loaded machine.
        Submit a no-op job until one is accepted."""
        import subprocess
        import time

        deadline = time.monotonic() + timeout
        while True:
            cmd = [f"{VENV_BIN}/ray", "job", "submit", "--address", self.address, "--no-wait", "--", "true"]
            proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=120)
            if proc.returncode == 0:
                return
            if "No available agent" not in proc.stdout + proc.stderr or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Jobs API of {self.address} refuses jobs: {(proc.stdout + proc.stderr)[-2000:]}"
                )
            time.sleep(2)

    def stop(self) -> None:
        """Kill this head's processes only (`ray stop` would stop every Ray on the machine)."""
        from rayjobs.cluster import stop_processes

        stop_processes([re.escape(self.temp_dir), rf":{self.gcs_port}\b"])


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A `ray start --head` cluster (token auth on, 127.0.0.1) for the tests of one module."""
    head = RayHead(tmp_path_factory.mktemp("ray-head"))
    head.start()
    yield head
    head.stop()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 (sqlite store) for the tests of one module."""
    from rayjobs import mlflow_server as server

    store = tmp_path_factory.mktemp("mlflow-store")
    port = free_port()
    proc = server.start(str(store), port, log_path=str(store / "server.log"))
    yield {"uri": f"http://127.0.0.1:{port}", "port": port, "store": store, "proc": proc}
    server.stop(proc)


# Ranks are forked from a server that has imported these once (a spawned rank imported torch and the
# test's module afresh: about 2 s of CPU each, a third of the quick tiers' time on 2 cores). A rank still
# starts from the test's environment (passed along), directory and sys.path, as a spawned one did.
RANK_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "pytest", "conftest", "models"]
RANK_PRELOAD += ["rayjobs.checkpoint", "rayjobs.parallel", "rayjobs.stepping"]


def _rank_with_stack_dump(rank: int, environ: dict, dump_after: float, stacks_dir: str, fn, *args) -> None:
    """A rank that writes every thread's stack to ``stacks_dir`` if it is still running after ``dump_after`` s."""
    import faulthandler

    from benchmarks.base import run_rank_then_exit

    os.environ.clear()
    os.environ.update(environ)

    stacks = open(Path(stacks_dir) / f"rank_{rank}.txt", "w")  # kept open: faulthandler writes to it later
    faulthandler.dump_traceback_later(dump_after, file=stacks)
    run_rank_then_exit(rank, fn, *args)


def _run_ranks_once(fn, world: int, args: tuple, timeout: float) -> str:
    """Run the ranks once; "" when they finished, else what went wrong with the machine (a hang, a signal).

    An exception raised in a rank is the code's fault, not the machine's: it propagates as torch's
    ``ProcessRaisedException`` and fails the test at once.
    """
    import shutil
    import tempfile
    import time

    import torch.multiprocessing as mp

    stacks_dir = tempfile.mkdtemp(prefix="rank-stacks-")
    mp.set_forkserver_preload(RANK_PRELOAD)
    ctx = mp.start_processes(
        _rank_with_stack_dump,
        args=(dict(os.environ), max(timeout - 15, timeout / 2), stacks_dir, fn, *args),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                hung = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
                for rank in hung:
                    ctx.processes[rank].kill()
                stacks = "\n".join((Path(stacks_dir) / f"rank_{rank}.txt").read_text()[-3000:] for rank in hung)
                return f"rank(s) {hung} of {fn.__name__} still running after {timeout:.0f} s; their stacks:\n{stacks}"
    except mp.ProcessExitedException as exc:
        if exc.signal_name is None:
            raise
        return f"rank {exc.error_index} of {fn.__name__} died by {exc.signal_name}"
    finally:
        shutil.rmtree(stacks_dir, ignore_errors=True)
    return ""


def spawn_ranks(fn, world: int, args: tuple = (), timeout: float = 180.0) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` processes (forked from a preloaded server) that meet on a free port.

    In CI, gloo ranks have twice failed in ways this machine never reproduced (a SIGABRT at exit, a hang
    with no collective timing out). Such a machine fault is reported as a warning, with each rank's
    stacks, and the ranks run once more on a new port; a second fault fails the test. An exception in a
    rank, or a wrong result, fails it the first time.
    """
    fault = _run_ranks_once(fn, world, (world, free_port(), *args), timeout)
    if not fault:
        return
    warnings.warn(f"{fault}\nrunning the ranks once more", stacklevel=2)
    fault = _run_ranks_once(fn, world, (world, free_port(), *args), timeout)
    if fault:
        pytest.fail(f"twice: {fault}")


def checkpoint_weights(path: str, trust_model: str = "") -> dict:
    """A checkpoint's model weights, through `rayjobs export` (plain tensors, weights_only)."""
    import torch

    from rayjobs import checkpoint as ckpt

    out = Path(path).parent / (Path(path).name + ".pt")
    ckpt.export_weights(path, out, trust_model)
    return torch.load(out, weights_only=True)


def tiny_gpt2(path: Path) -> Path:
    """A 2-layer GPT-2 transformers config at ``path`` (byte vocabulary, no dropout): an ``hf:`` model."""
    from transformers import GPT2Config

    GPT2Config(
        vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    ).save_pretrained(path)  # fmt: skip
    return path
