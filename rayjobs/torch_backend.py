"""Ray Train's torch process-group backend, with a controller side that imports no torch.

Every ``fit()`` starts a Train controller actor, which unpickles the trainer's backend config and runs
its backend's ``on_start`` (the workers' process group) and ``on_shutdown``. Ray's ``TorchConfig``
lives in a module that imports torch at the top, so each controller imported torch for nothing
(about 1 s of CPU in a process that never touches a tensor, on the critical path of every run and
every Tune trial). ``TorchBackendConfig`` and ``TorchBackend`` here do what Ray's ``TorchConfig`` and
``_TorchBackend`` do for rayjobs' runs (gloo on CPU, NCCL on GPU, ``env://`` rendezvous at rank 0's
address; no TPU and no ``tcp://`` init, which rayjobs never asks for); the parts that need torch run
on the workers, through Ray's own functions, imported there.

``FixedScalingWithoutAutoscaler`` lives here too: the controller unpickles the scaling policy, and a
class defined beside ``rayjobs.trainer`` (which imports ``ray.train.torch``) imported torch with it.

A leaf: imports nothing of rayjobs, and of Ray only what the controller imports anyway.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray._private.ray_constants import env_integer
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S

logger = logging.getLogger(__name__)


@dataclass
class TorchBackendConfig(BackendConfig):
    """Ray's ``TorchConfig`` (backend, timeout; ``env://`` rendezvous) whose class imports no torch."""

    backend: str | None = None  # filled by TorchTrainer: nccl where the workers have GPUs, else gloo
    timeout_s: int = 1800

    @property
    def backend_cls(self) -> type[Backend]:
        return TorchBackend

    @property
    def train_func_context(self) -> Any:
        from ray.train.torch.config import TorchConfigContextManager  # on the driver, which has torch

        return TorchConfigContextManager

    @property
    def framework(self) -> Any:
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class TorchBackend(Backend):
    """Ray's ``_TorchBackend`` for GPU and CPU workers: rank 0's address, the torchrun variables on each
    worker, then ``init_process_group`` on all of them; the process group destroyed at the end."""

    def on_start(self, worker_group: Any, backend_config: TorchBackendConfig) -> None:
        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_master, addr=addr, port=port)
        worker_group.execute(_set_torch_distributed_env_vars)
        ray.get(
            [
                worker_group.execute_single_async(
                    rank,
                    _setup_torch_process_group,
                    backend=backend_config.backend,
                    world_rank=rank,
                    world_size=len(worker_group),
                    init_method="env://",
                    timeout_s=backend_config.timeout_s,
                )
                for rank in range(len(worker_group))
            ]
        )

    def on_shutdown(self, worker_group: Any, backend_config: TorchBackendConfig) -> None:
        from ray.exceptions import GetTimeoutError

        futures = worker_group.execute_async(_shutdown_torch, destroy_process_group=len(worker_group) > 1)
        timeout_s = env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            logger.warning(f"Torch process group shutdown timed out after {timeout_s} seconds")


# Run on the workers (pickled by reference to this module): Ray's own, imported there.


def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


def _set_torch_distributed_env_vars() -> None:
    from ray.train.torch import config

    config._set_torch_distributed_env_vars()


def _setup_torch_process_group(**kwargs: Any) -> None:
    from ray.train.torch import config

    config._setup_torch_process_group(**kwargs)


def _shutdown_torch(destroy_process_group: bool = False) -> None:
    from ray.train.torch import config

    config._shutdown_torch(destroy_process_group=destroy_process_group)


try:  # Ray Train V2's internals; where they move, rayjobs.trainer keeps Ray's own policy
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy
except ImportError:  # pragma: no cover - other Ray versions
    FixedScalingPolicy = None  # type: ignore[assignment,misc]

if FixedScalingPolicy is not None:

    class FixedScalingWithoutAutoscaler(FixedScalingPolicy):
        """Ray Train's fixed-size policy that sends no resource request: on a local Ray with no
        autoscaler the request only started the coordinator actor that would have received it."""

        def after_controller_start(self, train_run_context: Any) -> None:
            self._requester_id = f"train-{train_run_context.run_id}"

        def _maybe_send_resource_request(self) -> None:
            pass

        def _send_resource_request(self) -> None:
            pass
