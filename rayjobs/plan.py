"""LaunchPlan: the typed, frozen contract that crosses the Ray boundary, driver to worker.

The driver resolves everything a worker must not recompute (the scaling, the MLflow run, the
storage mark, a streamed source's shape) into one ``LaunchPlan``; it travels as a plain dict
(``to_dict``, what ``train_loop_config`` takes) and the worker rebuilds it (``from_dict``). A
leaf: imports nothing of rayjobs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class ScalingPlan:
    """The resolved scaling of a run: what ``auto`` became on this machine or cluster."""

    num_workers: int
    use_gpu: bool
    resources_per_worker: dict[str, float]
    max_workers: int = 0  # elastic runs: grow from num_workers up to this; 0 = a fixed size

    @property
    def world_size(self) -> int:
        """Processes in the job (local mode counts as one)."""
        return max(1, self.num_workers)

    @property
    def cpus_per_worker(self) -> float:
        """CPUs each worker holds (its torch threads on CPU)."""
        return self.resources_per_worker.get("CPU", 1.0)


@dataclass(frozen=True)
class StreamPlan:
    """A source streamed through Ray Data, as the driver counted it."""

    kind: str  # "image" or "tokens"
    shape: tuple[int, ...]  # one sample
    classes: int  # classes, or the vocabulary size
    train_rows: int
    has_test: bool
    world_size: int
    in_memory: bool  # small enough to read once per worker and train on from memory


@dataclass(frozen=True)
class TrackingPlan:
    """The MLflow run the driver made for this run (run_id None: MLflow was away at the start)."""

    run_id: str | None
    run_key: str
    spool: str


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one worker needs: the config (a ``RunConfig.model_dump``) and what the driver resolved."""

    config: dict[str, Any]
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    local_mode: bool = False
    stop_at_step: int | None = None  # a PBT segment ends here (the schedule keeps the whole run's length)
    exploit: bool = False  # a PBT exploit: checkpoint.resume_from replaces the trial's own newest checkpoint
    memory_estimate_bytes: float | None = None
    storage_mark: str | None = None  # the driver's mark every worker must read (shared storage)
    tracking: TrackingPlan | None = None
    stream: StreamPlan | None = None
    init_from: str = ""  # model.init_from resolved by the driver to a local checkpoint directory
    launch_marks: dict[str, float] = field(default_factory=dict)  # the driver's side of rayjobs.timeline

    def to_dict(self) -> dict[str, Any]:
        """A plain dict for ``train_loop_config`` (nested plans as dicts)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchPlan:
        """Rebuild the plan a driver sent (unknown keys are an error: driver and worker disagree)."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise TypeError(
                f"LaunchPlan: unknown keys {sorted(unknown)}; the driver and the worker run different rayjobs"
            )
        values = dict(data)
        if values.get("tracking") is not None:
            values["tracking"] = TrackingPlan(**values["tracking"])
        if values.get("stream") is not None:
            stream = dict(values["stream"])
            stream["shape"] = tuple(stream["shape"])
            values["stream"] = StreamPlan(**stream)
        return cls(**values)
