"""Pure PyTorch models and their registry. No ``torch.distributed`` in here."""

from models.registry import (
    DataInfo,
    ModelSpec,
    ParallelPlan,
    build_model,
    flops_per_sample,
    get_spec,
    is_import_path,
    model_names,
    parallel_plan,
    register,
)

# The shipped models register themselves on import (they import models.registry, never this package).
from models import digits_cnn, gpt, mlp  # noqa: E402,F401  isort: skip

__all__ = [
    "DataInfo",
    "ModelSpec",
    "ParallelPlan",
    "build_model",
    "flops_per_sample",
    "get_spec",
    "is_import_path",
    "model_names",
    "parallel_plan",
    "register",
]
