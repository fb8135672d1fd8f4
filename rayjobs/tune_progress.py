"""The search's console progress: one compact line per event (a Tune callback on the driver)."""

from __future__ import annotations

import sys
from typing import Any

from ray.tune import Callback


class ProgressLine(Callback):
    """Trials running and done, best so far, printed as one line whenever something changes."""

    def __init__(self, metric: str, mode: str) -> None:
        self.metric, self.mode = metric, mode
        self.best: tuple[float, str] | None = None

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        """A trial reported: update the best, print the line."""
        value = result.get(self.metric)
        if isinstance(value, (int, float)) and (
            self.best is None or (value > self.best[0] if self.mode == "max" else value < self.best[0])
        ):
            self.best = (float(value), trial.trial_id)
        self._print(trials)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        """A trial ended (finished or stopped early): print the line."""
        self._print(trials)

    def _print(self, trials: list) -> None:
        counts: dict[str, int] = {}
        for t in trials:
            counts[t.status] = counts.get(t.status, 0) + 1
        state = ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items()))
        best = f"; best {self.metric} {self.best[0]:.4f} (trial {self.best[1]})" if self.best else ""
        sys.stdout.write(f"[tune] {state}{best}\n")
        sys.stdout.flush()
