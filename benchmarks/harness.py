"""The benchmarks harness: run the selected benchmarks, print a table, write JSON and a PNG chart.

Every figure is a ratio measured side by side in one run, with the goal it is held to.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import launch
from benchmarks.base import BENCHMARKS, Benchmark, Size, rehearsing_gpu_on_cpu


def load_all() -> dict[str, Benchmark]:
    """Import every benchmark module (each registers itself)."""
    from benchmarks import (  # noqa: F401
        checkpointing,
        compute,
        gpu,
        ingest,
        orchestration,
        overhead,
        parallelism,
        scaling,
        search,
        startup,
        tracking,
    )

    return BENCHMARKS


def machine() -> dict[str, Any]:
    """The hardware and software a run was measured on."""
    import torch

    info = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import ray

        info["ray"] = ray.__version__
    except ImportError:
        pass
    return info


def run(names: list[str], size: Size, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the named benchmarks (all when empty) at ``size`` and return {machine, size, figures, benchmarks}."""
    benches = load_all()
    unknown = [n for n in names if n not in benches]
    if unknown:
        raise KeyError(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(benches)}")
    selected = [benches[n] for n in (names or benches)]
    results: dict[str, Any] = {
        "machine": machine(),
        "size": size.name,
        "quick": size.name != "full",
        "figures": {},
        "benchmarks": {},
    }
    # Smoke: the benchmarks that launch the same workload share one launch of it (benchmarks.launch),
    # and those that only launch subprocesses run beside the others (its figures are not compared).
    beside = [b for b in selected if size.name == "smoke" and b.subprocesses_only]
    if beside:
        log = _one_line_at_a_time(log)
    with launch.sharing() if size.name == "smoke" else contextlib.nullcontext():
        with ThreadPoolExecutor(max(1, len(beside)), thread_name_prefix="bench-beside") as pool:
            started = {b.name: pool.submit(_run_one, b, size, log) for b in beside}
            done = {b.name: _run_one(b, size, log) for b in selected if b.name not in started}
            done.update({name: future.result() for name, future in started.items()})
    for bench in selected:  # in the order asked for, whichever finished first
        info, figures = done[bench.name]
        results["benchmarks"][bench.name] = info
        results["figures"].update(figures)
    return results


def _one_line_at_a_time(log: Callable[[str], None]) -> Callable[[str], None]:
    """``log`` for several threads: print writes a line and its newline apart, so two lines ran together."""
    lock = threading.Lock()

    def locked(line: str) -> None:
        with lock:
            log(line)

    return locked


def _run_one(bench: Benchmark, size: Size, log: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run one benchmark: what it ran and its figures by key (skipped, with its reason, when it needs CUDA
    and there is none)."""
    import torch

    if bench.needs == "cuda" and not torch.cuda.is_available() and not rehearsing_gpu_on_cpu():
        log(f"bench: {bench.name}: skipped (needs CUDA)")
        return {"skipped": "needs CUDA"}, {}
    log(f"bench: {bench.name}: {bench.workload}")
    t0 = time.time()
    figures = bench.run(size)
    info = {"workload": bench.workload, "compares": bench.compares, "seconds": round(time.time() - t0, 1)}
    return info, {fig.key: {**asdict(fig), "met": fig.met} for fig in figures}


def format_table(results: dict[str, Any]) -> str:
    """The results as a Markdown table: figure, value, goal, met."""
    rows = ["| figure | value | goal | met | note |", "|---|---|---|---|---|"]
    for key, f in results["figures"].items():
        value = f"{f['value']:.3g}" if math.isfinite(f["value"]) else str(f["value"])
        met = {True: "yes", False: "no", None: ""}[f["met"]]
        rows.append(
            f"| `{key}` | {value}{(' ' + f['unit']) if f['unit'] else ''} | {f['goal']} | {met} | {f['note']} |"
        )
    m = results["machine"]
    mode = "" if results["size"] == "full" else f", {results['size']} mode"
    rows.append("")
    rows.append(
        f"Measured {m['date']} on {m['cores']} cores ({m['cpu']}), GPU: {m['gpu'] or 'none'}, "
        f"torch {m['torch']}, ray {m.get('ray', '?')}{mode}."
    )
    return "\n".join(rows)


def write_json(results: dict[str, Any], path: str) -> None:
    """Write the results as JSON (figures keyed ``<benchmark>.<figure>``)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=2, sort_keys=True))


def draw_chart(results: dict[str, Any], path: str) -> None:
    """A horizontal bar per ratio figure, with its goal marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = [(k, f) for k, f in results["figures"].items() if f["ratio"]]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(figs) + 1.2))
    for i, (_key, f) in enumerate(figs):
        colour = {True: "tab:green", False: "tab:red", None: "tab:gray"}[f["met"]]
        ax.barh(i, f["value"], color=colour)
        if f["goal"]:
            target = float(f["goal"].split()[1])
            ax.plot([target, target], [i - 0.4, i + 0.4], color="black", linewidth=2)
    ax.set_yticks(range(len(figs)), [k for k, _ in figs])
    ax.invert_yaxis()
    ax.set_xlabel("ratio (black tick: goal; green: met, red: not met)")
    ax.set_title(f"rayjobs benchmarks, {results['machine']['date']}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_timelines(results: dict[str, Any], path: str) -> bool:
    """One stacked bar per figure with ``parts`` (a launch's phases); False when there are none."""
    figs = [(k, f) for k, f in results["figures"].items() if f.get("parts")]
    if not figs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = list(dict.fromkeys(p for _, f in figs for p in f["parts"]))
    colours = dict(zip(phases, plt.get_cmap("tab10").colors))
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(figs) + 2.0))
    for i, (_key, f) in enumerate(figs):
        left = 0.0
        for phase, seconds in f["parts"].items():
            ax.barh(i, seconds, left=left, color=colours[phase], label=phase)
            left += seconds
    ax.set_yticks(range(len(figs)), [k.split(".", 1)[1].removesuffix("_first_step_s") for k, _ in figs])
    ax.invert_yaxis()
    ax.set_xlabel("seconds to the first step")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=8, fontsize=8)
    ax.set_title(f"launch timeline, {results['machine']['date']}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
