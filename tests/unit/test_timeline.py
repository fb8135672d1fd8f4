"""The launch timeline's arithmetic: phases in order, clamped, a missing mark leaves its phases out."""

from __future__ import annotations

import pytest

from rayjobs import timeline

MARKS = {
    "driver_start": 100.0,
    "ray_start": 102.0,
    "ray_ready": 106.0,
    "tracking_ready": 106.75,
    "fit": 107.0,
    "worker_start": 109.0,
    "worker_entered": 113.0,
    "data_ready": 113.5,
    "model_ready": 114.0,
    "first_step": 114.25,
}


def test_phases_follow_the_marks_in_launch_order():
    assert timeline.phases(MARKS) == [
        ("driver", 2.0),
        ("ray", 4.0),
        ("mlflow", 0.75),
        ("datasets", 0.25),
        ("workers", 2.0),
        ("imports", 4.0),
        ("data", 0.5),
        ("model", 0.5),
        ("first step", 0.25),
    ]
    assert timeline.first_step_after(MARKS) == pytest.approx(14.25)
    assert timeline.describe(MARKS) == (
        "first step after 14.2 s: driver 2.0 s, ray 4.0 s, mlflow 0.8 s, datasets 0.2 s, workers 2.0 s, imports 4.0 s, "
        "data 0.5 s, model 0.5 s, first step 0.2 s"
    )


def test_a_worker_started_before_fit_counts_from_fit():
    """Local mode (the worker is the driver) or a Ray worker started ahead of need: no negative phase."""
    marks = {**MARKS, "worker_start": 50.0}
    phases = dict(timeline.phases(marks))
    assert phases["workers"] == 0 and phases["imports"] == 6.0
    assert timeline.first_step_after(marks) == pytest.approx(14.25)


def test_a_restart_times_its_worker_only():
    worker = {k: v for k, v in MARKS.items() if k in timeline.WORKER_MARKS}
    assert [p for p, _ in timeline.phases(worker)] == ["imports", "data", "model", "first step"]
    assert timeline.as_metrics(worker) == {
        "launch/imports_s": 4.0,
        "launch/data_s": 0.5,
        "launch/model_s": 0.5,
        "launch/first_step_s": 0.25,
        "launch/first_step_after_s": 5.25,
    }


def test_only_the_first_run_in_a_fresh_process_starts_at_the_process(monkeypatch):
    import time

    started = time.time() - 5  # the CLI: imports and config before the run begins
    monkeypatch.setattr(timeline, "process_start", lambda: started)
    timeline._first_run_in_process = True
    first = timeline.driver_start()
    second = timeline.driver_start()
    assert first == started and second >= started + 5

    # A process running long before its first run (a notebook, a test session): the run starts now.
    monkeypatch.setattr(timeline, "process_start", lambda: time.time() - 10 * timeline.FRESH_PROCESS_S)
    timeline._first_run_in_process = True
    assert timeline.driver_start() == pytest.approx(time.time(), abs=1)
