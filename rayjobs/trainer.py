"""Ray Train's ``TorchTrainer``, less the helper actors a run does not use.

Every ``fit()`` of Ray Train V2 starts, besides the controller and the workers, a dataset manager
actor (also for a run with no Ray Dataset), a detached placement-group cleaner (which removes the
workers' placement group when a controller dies while its driver lives on, as a Tune trial stopped
early does), and Ray Data's autoscaling coordinator, to which the controller sends the workers'
resources as a request for the cluster's autoscaler (and Ray Data reads what Train reserved). Each is
a process that imports Ray Train or Ray Data, 1-2 s of CPU on the critical path of a small machine.
``Trainer`` leaves out the dataset manager where the run has no datasets; where the driver started
the local Ray itself, it leaves out the cleaner (that Ray, placement groups and all, ends with the
driver) and, for a run with no datasets, the coordinator (that Ray has no autoscaler to ask and no
Ray Data execution to share with). Its process group comes from ``rayjobs.torch_backend`` (Ray's
own setup, with a controller that imports no torch). Everything else is ``TorchTrainer``'s own.

Imported only where a run is launched (it imports Ray Train).
"""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer

from rayjobs.torch_backend import FixedScalingPolicy, TorchBackendConfig

try:  # Ray Train V2's internals; where they move, the trainer keeps every helper (as TorchTrainer does)
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
except ImportError:  # pragma: no cover - other Ray versions
    DatasetsCallback = PlacementGroupCleanerCallback = None  # type: ignore[assignment,misc]


class Trainer(TorchTrainer):
    """``TorchTrainer`` without a dataset manager for a run with no datasets, and, where ``own_local_ray``
    (a Ray that ends with this driver and has no autoscaler), without a placement group cleaner and,
    for a run with no datasets, without Ray Data's autoscaling coordinator."""

    def __init__(self, *args: Any, own_local_ray: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("torch_config", TorchBackendConfig())  # the controller then imports no torch
        super().__init__(*args, **kwargs)
        self._unused_helpers = unused_helpers(bool(self.datasets), own_local_ray)
        self._ask_no_autoscaler = own_local_ray and not self.datasets

    def _create_default_callbacks(self) -> list[Any]:
        callbacks = super()._create_default_callbacks()
        return [c for c in callbacks if not isinstance(c, self._unused_helpers)]

    def _initialize_and_run_controller(self, **kwargs: Any) -> Any:
        policy = kwargs.get("scaling_policy")
        if self._ask_no_autoscaler and FixedScalingPolicy is not None and type(policy) is FixedScalingPolicy:
            from rayjobs.torch_backend import FixedScalingWithoutAutoscaler

            kwargs["scaling_policy"] = FixedScalingWithoutAutoscaler(policy.scaling_config)
        return super()._initialize_and_run_controller(**kwargs)


def unused_helpers(has_datasets: bool, own_local_ray: bool) -> tuple[type, ...]:
    """The default callback classes (each starts a helper actor) a run can do without."""
    unused = []
    if not has_datasets and DatasetsCallback is not None:
        unused.append(DatasetsCallback)
    if own_local_ray and PlacementGroupCleanerCallback is not None:
        unused.append(PlacementGroupCleanerCallback)
    return tuple(unused)
