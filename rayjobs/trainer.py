"""Ray Train's ``TorchTrainer``, less the helper actors a run does not use.

Every ``fit()`` of Ray Train V2 starts, besides the controller and the workers, a dataset manager
actor (also for a run with no Ray Dataset) and a detached placement-group cleaner (which removes the
workers' placement group when a controller dies while its driver lives on, as a Tune trial stopped
early does). Each is a process that imports Ray Train, 1-2 s of CPU on the critical path of a small
machine. ``Trainer`` leaves out the dataset manager where the run has no datasets, and the cleaner
where the driver started the local Ray itself: that Ray, placement groups and all, ends with the
driver. Everything else is ``TorchTrainer``'s own.

Imported only where a run is launched (it imports Ray Train).
"""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer

try:  # Ray Train V2's internals; where they move, the trainer keeps every helper (as TorchTrainer does)
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
except ImportError:  # pragma: no cover - other Ray versions
    DatasetsCallback = PlacementGroupCleanerCallback = None  # type: ignore[assignment,misc]


class Trainer(TorchTrainer):
    """``TorchTrainer`` without a dataset manager for a run with no datasets, and without a placement
    group cleaner where ``keep_placement_group_cleaner`` is False (a Ray that ends with this driver)."""

    def __init__(self, *args: Any, keep_placement_group_cleaner: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unused_helpers = unused_helpers(bool(self.datasets), keep_placement_group_cleaner)

    def _create_default_callbacks(self) -> list[Any]:
        callbacks = super()._create_default_callbacks()
        return [c for c in callbacks if not isinstance(c, self._unused_helpers)]


def unused_helpers(has_datasets: bool, keep_placement_group_cleaner: bool) -> tuple[type, ...]:
    """The default callback classes (each starts a helper actor) a run can do without."""
    unused = []
    if not has_datasets and DatasetsCallback is not None:
        unused.append(DatasetsCallback)
    if not keep_placement_group_cleaner and PlacementGroupCleanerCallback is not None:
        unused.append(PlacementGroupCleanerCallback)
    return tuple(unused)
