"""The search's console progress: a per-trial table every few seconds, as Tune's own reporter shows.

[tune] 2 running, 1 terminated; best val/accuracy 0.9741 (trial 5e0c1_00001)
trial        optim.lr   model.kwargs.width  state       iter  val/accuracy
5e0c1_00000  0.00123    32                  RUNNING        2  0.9630
...
"""

from __future__ import annotations

import sys
import time
from typing import Any

from ray.tune import Callback


class ProgressTable(Callback):
    """A Tune callback on the driver: the trials table at most every ``interval_s``, and at each trial's end."""

    def __init__(self, metric: str, mode: str, params: list[str], interval_s: float = 10.0) -> None:
        self.metric, self.mode, self.params, self.interval_s = metric, mode, params, interval_s
        self.best: tuple[float, str] | None = None
        self.last: dict[str, Any] = {}  # trial id -> its newest result
        self.printed_at = 0.0

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        """A trial reported: update the best; print the table when the interval has passed."""
        self.last[trial.trial_id] = result
        value = result.get(self.metric)
        if isinstance(value, (int, float)) and (
            self.best is None or (value > self.best[0] if self.mode == "max" else value < self.best[0])
        ):
            self.best = (float(value), trial.trial_id)
        if time.monotonic() - self.printed_at >= self.interval_s:
            self._print(trials)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        """A trial ended (finished or stopped early): print the table."""
        self._print(trials)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        """A trial failed: print the table (its state says ERROR)."""
        self._print(trials)

    def _print(self, trials: list) -> None:
        self.printed_at = time.monotonic()
        sys.stdout.write(format_table(trials, self.last, self.params, self.metric, self.best) + "\n")
        sys.stdout.flush()


def format_table(
    trials: list, last: dict[str, Any], params: list[str], metric: str, best: tuple[float, str] | None
) -> str:
    """The status line and one row per trial: id, its sampled parameters, state, iterations, the metric."""
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.status] = counts.get(t.status, 0) + 1
    state = ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items()))
    head = f"[tune] {state}" + (f"; best {metric} {best[0]:.4f} (trial {best[1]})" if best else "")
    header = ["trial", *params, "state", "iter", metric]
    rows = [header]
    for t in trials:
        result = last.get(t.trial_id, {})
        value = result.get(metric)
        rows.append(
            [
                str(t.trial_id),
                *(_fmt(t.config.get(p)) for p in params),
                str(t.status),
                str(result.get("training_iteration", 0)),
                f"{value:.4f}" if isinstance(value, (int, float)) else "-",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([head, *lines])


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)
