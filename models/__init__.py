"""Pure PyTorch models and their registry. No ``torch.distributed`` in here."""

from models.registry import (
    DataInfo,
    ModelSpec,
    build_model,
    flops_per_sample,
    get_spec,
    is_import_path,
    model_names,
    register,
)

__all__ = [
    "DataInfo",
    "ModelSpec",
    "build_model",
    "flops_per_sample",
    "get_spec",
    "is_import_path",
    "model_names",
    "register",
]
