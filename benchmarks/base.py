"""What every benchmark module is built from: Figure, Benchmark, the registry, and the environment
of a measured subprocess. A leaf of benchmarks/ (the harness imports the modules, they import this)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GCS_PORT_VARIABLE = "RAY_GCS_SERVER_PORT"  # rayjobs.launch's, not imported: this is a leaf of benchmarks/
GPU_REHEARSAL_ENV = "RAYJOBS_GPU_CHECK"  # "cpu": run the GPU benchmark on the CPU (benchmarks/gpu_check.sh --cpu)


def rehearsing_gpu_on_cpu() -> bool:
    """Whether the GPU checks run as their CPU rehearsal (``RAYJOBS_GPU_CHECK=cpu``)."""
    return os.environ.get(GPU_REHEARSAL_ENV, "") == "cpu"


@dataclass
class Figure:
    """One measured figure: ``<benchmark>.<name>``, its value, and the goal it is held to."""

    key: str
    value: float
    goal: str = ""  # e.g. "<= 1.02", ">= 0.85"; empty: informational
    unit: str = ""
    note: str = ""
    ratio: bool = True  # a unitless ratio (drawn on the chart)
    parts: dict[str, float] = field(default_factory=dict)  # a timeline's phases, in order (the timeline chart)

    @property
    def met(self) -> bool | None:
        """Whether the value meets the goal (None when there is no goal)."""
        if not self.goal:
            return None
        op, target = self.goal.split()
        return self.value <= float(target) if op == "<=" else self.value >= float(target)


@dataclass(frozen=True)
class Size:
    """How long a benchmark runs: ``full`` (the figures), ``quick`` (minutes), ``smoke`` (its code path, seconds)."""

    name: str = "full"

    def pick(self, full: Any, quick: Any, smoke: Any = None) -> Any:
        """The value for this size (``smoke`` falls back to ``quick``)."""
        if self.name == "full":
            return full
        return quick if self.name == "quick" or smoke is None else smoke


FULL, QUICK, SMOKE = Size("full"), Size("quick"), Size("smoke")


def run_calls(calls: list[Callable[[], Any]], size: Size) -> list[Any]:
    """Each call's result, in order. A smoke starts them all at once (they are subprocesses that
    mostly wait for their own Ray to start; its figures are not compared), a measured size runs them
    one after another, so no run's time holds another's."""
    if size.name != "smoke" or len(calls) < 2:
        return [call() for call in calls]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls), thread_name_prefix="bench-smoke") as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def rounds_note(ratios: list[float]) -> str:
    """The spread of a ratio over alternated rounds: ``; per round 0.97, 0.99, 0.98 (0.97-0.99)``."""
    if len(ratios) < 2:
        return "; one round"
    shown = ", ".join(f"{r:.3f}" for r in ratios)
    return f"; per round {shown} ({min(ratios):.3f}-{max(ratios):.3f})"


@dataclass
class Benchmark:
    """A benchmark: what it runs, what it compares, and the function that measures it."""

    name: str
    workload: str
    compares: str
    run: Callable[[Size], list[Figure]]
    needs: str = ""  # "cuda" for GPU-only benchmarks
    subprocesses_only: bool = False  # measures only the subprocesses it starts: a smoke runs it beside the others
    figures: list[Figure] = field(default_factory=list)


BENCHMARKS: dict[str, Benchmark] = {}


def register(bench: Benchmark) -> Benchmark:
    """Add a benchmark to the harness."""
    BENCHMARKS[bench.name] = bench
    return bench


def subprocess_env(threads: int = 1) -> dict[str, str]:
    """Environment for a launched workload: the repo importable, ``threads`` BLAS threads."""
    env = dict(os.environ)
    # Set in this process only while one of its threads starts a local Ray (launch.start_local_ray): a
    # smoke's subprocess started then took that GCS port for its own Ray and failed ("Session name
    # ... does not match persisted value").
    env.pop(GCS_PORT_VARIABLE, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_rank_then_exit(rank: int, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(rank, *args)`` in a spawned rank; once every rank is done, leave without tearing gloo down.

    ``fn`` creates the process group and does not destroy it. Destroying a gloo group, and then freeing
    the last objects that hold it (a DDP model) when ``fn`` returns, hung ranks in C++ with no
    collective timing out (2 of 60 runs of a 2-rank test beside two busy loops; stacks showed the rank
    returning from ``fn``), and at interpreter exit aborted them ("terminate called without an active
    exception"). So: a barrier, then ``os._exit(0)``, skipping every destructor. An error in ``fn``
    still raises here, so torch's spawn reports it as the rank's failure.
    """
    import torch.distributed as dist

    fn(rank, *args)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
