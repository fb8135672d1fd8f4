"""RunDir: every path and ledger of one run directory (``<storage_path>/<run.name>``).

The run's files are named here and nowhere else:

    metrics.jsonl         one line per report (rank 0's metrics), the run's history
    events.jsonl          timed events: start, first step, trial start (launch timings)
    .mlflow-spool.jsonl   metrics waiting for MLflow (written before they are sent)
    .attempts             how many times the run has started (an MLflow tag per attempt)
    pbt_exploits.jsonl    a PBT trial's exploits: whose checkpoint it cloned, at which step

and the MLflow sqlite store of a storage path, ``<storage_path>/mlflow.db``. A leaf: imports nothing
of rayjobs.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MLFLOW_DB = "mlflow.db"


def mlflow_db(storage_path: str | os.PathLike[str]) -> str:
    """The MLflow sqlite file of a storage path (the default tracking store)."""
    return os.path.join(storage_path, MLFLOW_DB)


@dataclass(frozen=True)
class RunDir:
    """One run's directory and the ledgers in it."""

    path: str

    @property
    def metrics(self) -> str:
        """The history: one JSON line per report."""
        return os.path.join(self.path, "metrics.jsonl")

    @property
    def events(self) -> str:
        """Timed events (start, first step, trial start)."""
        return os.path.join(self.path, "events.jsonl")

    @property
    def spool(self) -> str:
        """Rank 0's MLflow spool: metrics are written here before they are sent."""
        return os.path.join(self.path, ".mlflow-spool.jsonl")

    @property
    def attempts(self) -> str:
        """The count of starts of this run."""
        return os.path.join(self.path, ".attempts")

    @property
    def exploits(self) -> str:
        """A PBT trial's exploits."""
        return os.path.join(self.path, "pbt_exploits.jsonl")

    def append_history(self, metrics: dict[str, Any]) -> None:
        """Append one report's numeric metrics to ``metrics.jsonl``."""
        entry = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        self._append(self.metrics, {**entry, "time": time.time()})

    def read_history(self) -> list[dict[str, Any]]:
        """Every report by step, oldest first (see ``read_history``)."""
        return read_history(self.metrics)

    def record_event(self, event: str, **fields: Any) -> None:
        """Append ``{event, time, ...}`` to ``events.jsonl``."""
        self._append(self.events, {"event": event, "time": time.time(), **fields})

    def read_events(self, event: str) -> list[dict[str, Any]]:
        """Every ``event`` entry of ``events.jsonl``, oldest first."""
        return [e for e in _read_jsonl(self.events) if e.get("event") == event]

    def next_attempt(self) -> int:
        """Count one more start of the run (a file: works while MLflow is away)."""
        path = Path(self.attempts)
        path.parent.mkdir(parents=True, exist_ok=True)
        n = int(path.read_text() or 0) + 1 if path.exists() else 1
        path.write_text(str(n))
        return n

    def record_exploit(self, event: dict[str, Any]) -> None:
        """Append one PBT exploit."""
        self._append(self.exploits, event)

    def read_exploits(self) -> list[dict[str, Any]]:
        """Every PBT exploit of this trial, oldest first."""
        return _read_jsonl(self.exploits)

    def _append(self, path: str, entry: dict[str, Any]) -> None:
        os.makedirs(self.path, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def read_history(metrics_path: str) -> list[dict[str, Any]]:
    """Every report of a ``metrics.jsonl`` by step, oldest first; a step replayed after a resume counts
    once (the last)."""
    by_step: dict[Any, dict[str, Any]] = {}
    for entry in _read_jsonl(metrics_path):
        by_step[entry.get("step")] = entry
    return sorted(by_step.values(), key=lambda e: e.get("step") or 0)


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
