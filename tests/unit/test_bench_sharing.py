"""The smoke's shortcuts: shared launches (benchmarks.launch.sharing: one launch per workload inside the
block, a fresh one for each request outside it) and runs at once (base.run_calls, the harness)."""

from __future__ import annotations

import threading
import time

from benchmarks import harness, launch
from benchmarks.base import QUICK, SMOKE, Benchmark, Figure, run_calls, subprocess_env


def test_a_workload_is_launched_once_while_sharing_and_every_time_outside():
    launched = []

    def launch_once(tag):
        launched.append(tag)
        return {"tag": tag, "n": len(launched)}

    with launch.sharing():
        first = launch._once(["torchrun", launch.SMOKE_SPEC, 2], lambda: launch_once("a"))
        again = launch._once(["torchrun", dict(reversed(launch.SMOKE_SPEC.items())), 2], lambda: launch_once("b"))
        other = launch._once(["torchrun", launch.SMOKE_SPEC, 1], lambda: launch_once("c"))
    assert again is first and other is not first and launched == ["a", "c"]
    assert launch._shared is None  # the block's records are gone with it
    launch._once(["torchrun", launch.SMOKE_SPEC, 2], lambda: launch_once("d"))
    launch._once(["torchrun", launch.SMOKE_SPEC, 2], lambda: launch_once("e"))
    assert launched == ["a", "c", "d", "e"]


def test_a_smoke_runs_its_calls_at_once_and_a_measured_size_one_after_another():
    meeting = threading.Barrier(2, timeout=10)  # broken (an error) unless both calls wait at once
    assert run_calls([lambda: meeting.wait() + 10, lambda: meeting.wait() + 20], SMOKE) in ([10, 21], [11, 20])
    spans = []

    def timed(tag):
        start = time.perf_counter()
        time.sleep(0.05)
        spans.append((start, time.perf_counter()))
        return tag

    assert run_calls([lambda: timed("a"), lambda: timed("b")], QUICK) == ["a", "b"]
    assert spans[0][1] <= spans[1][0]  # the second started after the first ended


def test_a_smoke_runs_a_subprocesses_only_benchmark_beside_the_others_and_keeps_the_order(monkeypatch):
    meeting = threading.Barrier(2, timeout=10)

    def bench(name, **kwargs):
        def run(size):
            meeting.wait()
            return [Figure(f"{name}.value", 1.0, ">= 1")]

        return Benchmark(name, "w", "c", run, **kwargs)

    fakes = {"first": bench("first"), "beside": bench("beside", subprocesses_only=True)}
    monkeypatch.setattr(harness, "load_all", lambda: fakes)
    lines = []
    results = harness.run(["beside", "first"], SMOKE, log=lines.append)
    assert list(results["figures"]) == ["beside.value", "first.value"]
    assert list(results["benchmarks"]) == ["beside", "first"] and sorted(lines) == [
        "bench: beside: w",
        "bench: first: w",
    ]


def test_a_measured_subprocess_never_inherits_the_port_of_a_local_ray_starting_in_this_process(monkeypatch):
    monkeypatch.setenv("RAY_GCS_SERVER_PORT", "50123")
    assert "RAY_GCS_SERVER_PORT" not in subprocess_env()
