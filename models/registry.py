"""A registry of model specs: name, flavors, builder, FLOPs per sample.

Models here are plain ``torch.nn`` modules; nothing in ``models/`` imports
``torch.distributed``. Parallelism is applied from outside (``rayjobs.parallel``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from models import hf


@dataclass(frozen=True)
class DataInfo:
    """What a model needs to know about its data to size its input and output layers."""

    kind: str  # "image" (features of any shape) or "tokens" (next-token prediction)
    input_shape: tuple[int, ...]  # shape of one sample, without the batch dimension
    num_classes: int  # the output width: classes; vocabulary size for "tokens"; outputs for real targets
    targets: str = "class"  # "class" (integer labels) or "real" (float targets: regression)


@dataclass(frozen=True)
class ParallelPlan:
    """How a model may be split, as plain data (rayjobs.parallel applies it; the model never sees it).

    ``layers_attr`` names the ``ModuleDict``/``ModuleList`` of repeated blocks (FSDP units,
    activation checkpointing, compile, pipeline stages); ``tp_plan`` maps module patterns (``*``
    matches one name) to ``"colwise"`` or ``"rowwise"``; a pipeline keeps ``pipeline_first`` on its
    first stage and ``pipeline_last`` on its last.
    """

    layers_attr: str = ""
    tp_plan: dict[str, str] = field(default_factory=dict)
    pipeline_first: tuple[str, ...] = ()
    pipeline_last: tuple[str, ...] = ()

    @property
    def can_pipeline(self) -> bool:
        """Whether the model has blocks to split into stages."""
        return bool(self.layers_attr)


NO_PARALLEL_PLAN = ParallelPlan()


@dataclass(frozen=True)
class ModelSpec:
    """How to build one registered model, and the flavors (size presets) it comes in."""

    name: str
    builder: Callable[..., nn.Module]
    flavors: dict[str, dict[str, Any]]
    data_kinds: tuple[str, ...]
    description: str = ""
    default_flavor: str = "default"
    flops_per_sample: Callable[[nn.Module, DataInfo], float] | None = None
    parallel: ParallelPlan = NO_PARALLEL_PLAN
    # The builder's numeric arguments: key -> (lowest allowed, first not allowed; None: no limit).
    ranges: dict[str, tuple[float, float | None]] = field(default_factory=dict)


_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Add a spec to the registry (every spec must have a ``debug`` flavor for tests)."""
    if "debug" not in spec.flavors or spec.default_flavor not in spec.flavors:
        raise ValueError(f"model spec {spec.name!r} needs a 'debug' flavor and its default flavor")
    _REGISTRY[spec.name] = spec
    return spec


def get_spec(name: str) -> ModelSpec:
    """Return the registered spec called ``name`` (KeyError if unknown)."""
    return _REGISTRY[name]


def model_names() -> list[str]:
    """Names of all registered models, sorted."""
    return sorted(_REGISTRY)


def parallel_plan(name: str) -> ParallelPlan:
    """The parallel plan of a registry model, or the one a user's ``module:callable`` builder carries as
    its ``parallel_plan`` attribute (``build.parallel_plan = ParallelPlan(...)``; none: an empty plan)."""
    if hf.is_hf(name):
        return ParallelPlan(layers_attr=hf.layers_attr(name))
    if not is_import_path(name):
        return get_spec(name).parallel
    plan = getattr(resolve_callable(name), "parallel_plan", NO_PARALLEL_PLAN)
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"{name}.parallel_plan must be a models.ParallelPlan, got {type(plan).__name__}")
    return plan


def is_import_path(name: str) -> bool:
    """True for a user's own model given as ``package.module:callable`` (not ``hf:<dir>``)."""
    return ":" in name and not hf.is_hf(name)


def is_registered(name: str) -> bool:
    """True for a model of this registry (not a user's callable, not ``hf:<dir>``)."""
    return ":" not in name


def resolve_callable(path: str) -> Callable[..., Any]:
    """Import ``package.module:attr`` and return the attribute (ImportError/AttributeError on failure)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ImportError(f"expected 'package.module:callable', got {path!r}")
    module = importlib.import_module(module_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise AttributeError(f"{path} is not callable")
    return obj


class NotAModule(TypeError):
    """A user's ``module:callable`` returned something other than an ``nn.Module``."""


def build_model(name: str, flavor: str, kwargs: dict[str, Any], info: DataInfo) -> nn.Module:
    """Build a registered model (flavor preset, then ``kwargs`` on top), ``hf:<dir>`` (``kwargs``
    replace config fields) or a user's callable."""
    if hf.is_hf(name):
        return hf.build(name, info, **kwargs)
    if is_import_path(name):
        model = resolve_callable(name)(**kwargs)
        if not isinstance(model, nn.Module):
            raise NotAModule(f"{name} returned {type(model).__name__}, not a torch.nn.Module")
        return model
    spec = get_spec(name)
    return spec.builder(info=info, **{**spec.flavors[flavor], **kwargs})


def count_flops_per_sample(model: nn.Module, info: DataInfo) -> float:
    """Training FLOPs for one sample (forward + backward ~ 3x forward), counted by torch."""
    from torch.utils.flop_counter import FlopCounterMode

    if info.kind == "tokens":
        x = torch.zeros((1, *info.input_shape), dtype=torch.long)
    else:
        x = torch.zeros((1, *info.input_shape))
    was_training = model.training
    model.eval()
    try:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(x)
    finally:
        model.train(was_training)
    return 3.0 * counter.get_total_flops()


def flops_per_sample(name: str, model: nn.Module, info: DataInfo) -> float:
    """Training FLOPs per sample: the spec's formula when it has one, else counted by torch."""
    if is_registered(name):
        spec = get_spec(name)
        if spec.flops_per_sample is not None:
            return spec.flops_per_sample(model, info)
    return count_flops_per_sample(model, info)
