"""The launch timeline: where the time to a run's first step goes, phase by phase.

The driver marks its side (its process start, Ray up, the MLflow run made, ``fit()`` called
once the datasets are made) and
the marks travel in the ``LaunchPlan``; rank 0 adds its own (its process start, the train function
entered, data ready, model ready, first step done) and turns them into phases:

    driver      the driver's Python start, imports and the checks before Ray
    ray         ``ray.init`` (0 on a Ray that was already up, and in local mode without Ray Data)
    mlflow      the MLflow run made for this run, beyond Ray's start where the two overlap (a local Ray)
    datasets    Ray Data's datasets made by the driver, a small one's val and test read once
    workers     ``fit()`` to the worker's process start: Train controller, placement group, actor
    imports     the worker's process start to the train function: imports, process group
    data        this rank's data
    model       build, parallelize, optimizer, resume
    first step  the first optimizer step (the first batch included)

A leaf: imports nothing of rayjobs. Marks are wall-clock seconds (``time.time()``), so a worker on
another node is off by the clocks' skew; phases are clamped at 0.
"""

from __future__ import annotations

import os
import time
from typing import Any

DRIVER_MARKS = ("driver_start", "ray_start", "ray_ready", "tracking_ready", "fit")
WORKER_MARKS = ("worker_start", "worker_entered", "data_ready", "model_ready", "first_step")
PHASES = (
    ("driver", "driver_start", "ray_start"),
    ("ray", "ray_start", "ray_ready"),
    ("mlflow", "ray_ready", "tracking_ready"),
    ("datasets", "tracking_ready", "fit"),
    ("workers", "fit", "worker_start"),
    ("imports", "worker_start", "worker_entered"),
    ("data", "worker_entered", "data_ready"),
    ("model", "data_ready", "model_ready"),
    ("first step", "model_ready", "first_step"),
)

_first_run_in_process = True


def process_start() -> float:
    """When this process started (wall clock), from the OS, to about 10 ms.

    psutil's ``create_time`` adds the start in clock ticks to a boot time that Linux gives in whole
    seconds (``btime`` in /proc/stat), so it read up to a second early: 1.0 s on the machine this
    was measured on, which made every launch phase that begins at a process start (driver, imports)
    a second longer than it was, and the one before it (workers) a second shorter. On Linux the
    start is counted back from /proc/uptime (hundredths of a second) instead.
    """
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name, in (), may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started_ticks = int(after_name[19])  # field 22, starttime: clock ticks after boot
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux
        import psutil

        return psutil.Process().create_time()


def driver_start() -> float:
    """Where a run's launch begins: the process's start for the first run in it, else now.

    A Tune trial's first run includes its actor's start; a later PBT segment in the same process
    (or a second run from one Python session) starts when it is called, and so does the first run
    of a process that was already running for a while (a notebook, a test session).
    """
    global _first_run_in_process
    first, _first_run_in_process = _first_run_in_process, False
    now, started = time.time(), process_start()
    return started if first and 0 <= now - started < FRESH_PROCESS_S else now


FRESH_PROCESS_S = 120.0  # a process started to run this job (the CLI, a trial actor) gets here sooner


def phases(marks: dict[str, float]) -> list[tuple[str, float]]:
    """Seconds per phase, in launch order; a phase whose marks are missing is left out.

    Each mark is at least the one before it (a process started before ``fit()``, such as a Ray worker
    started ahead of need or the driver itself in local mode, counts from ``fit()``).
    """
    order = [m for m in (*DRIVER_MARKS, *WORKER_MARKS) if m in marks]
    clamped, latest = {}, float("-inf")
    for name in order:
        latest = max(latest, marks[name])
        clamped[name] = latest
    return [
        (phase, clamped[end] - clamped[start]) for phase, start, end in PHASES if start in clamped and end in clamped
    ]


def first_step_after(marks: dict[str, float]) -> float:
    """Seconds from the launch's first mark to the first step's end."""
    return sum(seconds for _, seconds in phases(marks))


def describe(marks: dict[str, float]) -> str:
    """One line: ``first step after 14.2 s: driver 3.1 s, ray 4.0 s, ...`` (phases over 0.05 s)."""
    shown = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in phases(marks) if seconds >= 0.05)
    return f"first step after {first_step_after(marks):.1f} s: {shown}"


def as_metrics(marks: dict[str, float]) -> dict[str, Any]:
    """``launch/<phase>_s`` and ``launch/first_step_after_s``, for MLflow and the event log."""
    out: dict[str, Any] = {f"launch/{phase.replace(' ', '_')}_s": round(s, 3) for phase, s in phases(marks)}
    out["launch/first_step_after_s"] = round(first_step_after(marks), 3)
    return out
