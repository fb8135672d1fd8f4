"""`rayjobs bench --smoke` runs every benchmark's code path and produces every figure, finite, with its
goal, a JSON file and a chart. The figures themselves come from `make bench` / `rayjobs bench --quick`."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EXPECTED = {
    "orchestration.step_time_ratio",
    "launch.cold_ratio",
    "launch.warm_ratio",
    "scaling.weak_efficiency_2w",
    "compute.mfu_cpu_gpt_small",
    "overhead.loop_throughput_ratio",
    "checkpoint.async_blocked_fraction_gpt_small",
    "tracking.step_time_ratio_logging_every_step",
    "tune.asha_steps_ratio",
    "tune.asha_best_ratio",
    "tune.trial_overhead_vs_train_start",
    "parallel.fsdp_state_memory_ratio_gpt_debug",
    "data.wait_fraction_default",
    "data.parquet_vs_memory_wall_ratio",
    "data.ray_data_vs_dataloader_rows_per_s",
}


def test_every_benchmark_runs_its_code_path_and_produces_its_figures(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "rayjobs", "bench", "--smoke", "--json", str(out)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = json.loads(out.read_text())
    figures = results["figures"]
    assert EXPECTED <= set(figures), set(figures)
    for key in EXPECTED:
        f = figures[key]
        assert math.isfinite(f["value"]) and f["value"] > 0, (key, f)
        assert f["goal"] and f["met"] in (True, False)
    assert "| `orchestration.step_time_ratio` |" in proc.stdout
    assert out.with_suffix(".png").stat().st_size > 5000
    # The launch timeline: each launcher's phases add up to its time to the first step, and are drawn.
    for launcher in ("torchrun", "ray_cold", "ray_warm"):
        f = figures[f"launch.{launcher}_first_step_s"]
        assert f["parts"] and abs(sum(f["parts"].values()) - f["value"]) < 0.5, f
    assert set(figures["launch.ray_cold_first_step_s"]["parts"]) >= {"driver", "ray", "workers", "imports", "model"}
    assert (tmp_path / "bench-timeline.png").stat().st_size > 5000
    assert results["size"] == "smoke" and "smoke mode" in proc.stdout
    assert results["benchmarks"]["gpu"] == {"skipped": "needs CUDA"} or any(k.startswith("gpu.") for k in figures)


def test_unknown_benchmark_is_a_one_line_error():
    proc = subprocess.run(
        [sys.executable, "-m", "rayjobs", "bench", "nosuch"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("rayjobs: error: bench: unknown benchmark(s) nosuch; known: ")


@pytest.mark.parametrize("entry", [["rayjobs", "bench"], ["benchmarks"]])
def test_two_sizes_at_once_are_a_one_line_error(entry):
    """`rayjobs bench --quick --smoke` ran the quick benchmarks as if --smoke were not there."""
    proc = subprocess.run(
        [sys.executable, "-m", *entry, "launch", "--quick", "--smoke"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.strip() == "rayjobs: error: bench: --quick and --smoke are two sizes of a run; give one of them"


def test_the_gpu_check_script_rehearses_every_step_on_the_cpu(tmp_path):
    """benchmarks/gpu_check.sh --cpu: the GPU script's train and `bench gpu` steps, on gloo and fp32."""
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--cpu"],
        cwd=REPO,
        env=subprocess_env(OUT=str(tmp_path / "gpu")),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    out = tmp_path / "gpu"
    assert "CPU rehearsal" in (out / "gpu.log").read_text()
    summary = json.loads((out / "train-summary.json").read_text())
    assert summary["checkpoint"].endswith("checkpoint_00000010") and math.isfinite(summary["metrics"]["test/accuracy"])
    figures = json.loads((out / "gpu-smoke.json").read_text())["figures"]
    for key in ("gpu.mfu_fp32_gpt_debug", "gpu.tokens_per_s_gpt_debug", "gpu.dataparallel_vs_ddp_step_ratio_gpt_debug"):
        assert math.isfinite(figures[key]["value"]) and figures[key]["value"] > 0, (key, figures)
    assert (out / "gpu-smoke.png").stat().st_size > 5000


def test_the_gpu_check_script_names_a_wrong_argument_in_one_line():
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--gpu"], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "gpu_check.sh: unknown argument --gpu; use --cpu or nothing"
