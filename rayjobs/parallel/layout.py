"""Strategies as data, and the Layout: the resolved degrees of a run and what follows from them.

A ``Strategy`` says which degrees it may set above 1, which one it derives from the world size,
and what it implies (sharded state, elastic world sizes, whether ranks see different batches).
A ``Layout`` is the resolved ``parallel:`` config: four degrees (pipeline stages, replicas,
shards, tensor-parallel ranks) whose product is the world size. Every other module asks the
Layout (memory, the driver, tracking) instead of matching strategy names.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

DEGREES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Strategy:
    """One named way to split a run: the degrees it may set, the one it derives, what it implies."""

    name: str
    allowed: frozenset[str]  # degrees this strategy may set above 1
    derived: str = ""  # the degree that takes the rest of the world size ("" : one process)
    defaults: dict[str, int] = field(default_factory=dict)  # degrees set when the config leaves them at 0
    sharded: bool = False  # FSDP2 shards parameters, gradients and optimizer state
    elastic: bool = False  # the world size may change between restarts (pure data parallelism)
    single_process: bool = False  # one process drives all of its node's devices (nn.DataParallel)

    @property
    def model_parallel(self) -> bool:
        """Whether ranks of one replica split the model (tensor or pipeline) and so need the same batches."""
        return bool(self.allowed & {"tp", "pp"})


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("ddp", frozenset({"dp_replicate"}), "dp_replicate", elastic=True),
        Strategy("fsdp", frozenset({"dp_shard"}), "dp_shard", sharded=True, elastic=True),
        Strategy("hsdp", frozenset({"dp_replicate", "dp_shard"}), "dp_shard", {"dp_replicate": 2}, sharded=True),
        Strategy("tp", frozenset({"tp"}), "tp"),
        Strategy("pp", frozenset({"pp"}), "pp"),
        Strategy("fsdp+tp", frozenset({"dp_replicate", "dp_shard", "tp"}), "dp_shard", {"tp": 2}, sharded=True),
        Strategy("pp+dp", frozenset({"pp", "dp_replicate"}), "dp_replicate", {"pp": 2}),
        Strategy("dataparallel", frozenset(), "", single_process=True),
    )
}


def strategy(name: str) -> Strategy:
    """The strategy called ``name`` (the config's list of names is checked against this table by a test)."""
    return STRATEGIES[name]


def elastic_strategies() -> list[str]:
    """Names of the strategies whose runs may change their world size."""
    return [s.name for s in STRATEGIES.values() if s.elastic]


@dataclass(frozen=True)
class Layout:
    """The resolved degrees of a run; their product is the world size."""

    strategy: str
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        """pp x dp_replicate x dp_shard x tp."""
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 shards parameters, gradients and optimizer state."""
        return STRATEGIES[self.strategy].sharded

    @property
    def elastic(self) -> bool:
        """Whether the world size may change between restarts."""
        return STRATEGIES[self.strategy].elastic

    @property
    def same_buffers(self) -> bool:
        """Whether every rank holds the whole model's buffers (not so for pipeline stages)."""
        return self.pp == 1

    def describe(self) -> str:
        """``fsdp+tp: dp_shard=2 x tp=2`` (the degrees above 1)."""
        parts = [f"{d}={getattr(self, d)}" for d in DEGREES if getattr(self, d) > 1]
        return f"{self.strategy}: {' x '.join(parts) or 'one rank'}"

    def coordinates(self, rank: int) -> dict[str, int]:
        """A rank's index along each mesh dimension (row-major over DEGREES, tp fastest)."""
        coords = {}
        for d in reversed(DEGREES):
            size = getattr(self, d)
            coords[d], rank = rank % size, rank // size
        return coords

    def stage_bounds(self, n_blocks: int) -> list[int]:
        """Block index bounds of the pipeline stages: stage s holds blocks [bounds[s], bounds[s+1])."""
        per, extra = divmod(n_blocks, self.pp)
        return [s * per + min(s, extra) for s in range(self.pp + 1)]

    def tp_sharded(self, model: nn.Module, tp_plan: dict[str, str]) -> list[str]:
        """Names of the modules that tensor parallelism shards (the plan's patterns; ``*`` is one name), in
        the model's order: every rank must shard them in the same order (their collectives pair up)."""
        if self.tp == 1:
            return []
        return [fqn for fqn, _ in model.named_modules() if any(plan_matches(fqn, p) for p in tp_plan)]


def plan_matches(fqn: str, pattern: str) -> bool:
    """Whether a module name matches a TP-plan pattern (``*`` matches exactly one name)."""
    return fnmatch.fnmatchcase(fqn, pattern) and fqn.count(".") == pattern.count(".")


def resolve_layout(p: Any, world_size: int) -> Layout:
    """The degrees of ``p`` (a ParallelSection) at this world size (ValueError naming the field when they do not fit)."""
    s = STRATEGIES[p.strategy]
    if s.single_process:
        if world_size > 1:
            raise ValueError(
                f"parallel.strategy={p.strategy}: one worker drives all GPUs of its node, but the run has "
                f"{world_size} workers; set scaling.num_workers=1, or use strategy ddp"
            )
        return Layout(p.strategy)
    degrees = {d: getattr(p, d) for d in DEGREES}
    for d, v in degrees.items():
        if v > 1 and d not in s.allowed:
            fits = [t.name for t in STRATEGIES.values() if d in t.allowed]
            raise ValueError(f"parallel.{d}={v} does not apply to strategy {p.strategy}; use {' or '.join(fits)}")
    for d, v in s.defaults.items():
        if not degrees[d]:
            degrees[d] = v if world_size % v == 0 and world_size >= v else 1
    rest = math.prod(v or 1 for d, v in degrees.items() if d != s.derived)
    if not degrees[s.derived]:
        if world_size % rest:
            raise ValueError(
                f"parallel: {' x '.join(f'{d}={v}' for d, v in degrees.items() if v)} = {rest} does not divide "
                f"the world size {world_size} (scaling.num_workers)"
            )
        degrees[s.derived] = world_size // rest
    layout = Layout(p.strategy, **{d: v or 1 for d, v in degrees.items()})
    if layout.world_size != world_size:
        raise ValueError(
            f"parallel: pp x dp_replicate x dp_shard x tp = {layout.world_size}, but the world size is "
            f"{world_size} (scaling.num_workers); make them multiply to {world_size}"
        )
    return layout


def microbatches(p: Any, layout: Layout) -> int:
    """Pipeline micro-batches per step: the configured number, or two per stage."""
    return p.microbatches or 2 * layout.pp
