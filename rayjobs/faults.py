"""Fault injection, off by default: kill a rank, raise, poison the loss, corrupt a checkpoint.

Each fault fires once per run (a marker file in ``<run_dir>/.faults/`` remembers it), so the
restarted or re-run job gets past it and the test can check that it resumed.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from rayjobs.checkpoint import latest_complete, write_marker
from rayjobs.config import FaultsSection
from rayjobs.context import WorkerContext
from rayjobs.log import log


class InjectedFault(RuntimeError):
    """The error that ``faults.raise_at_step`` raises."""


class Faults:
    """The faults a run asked for, fired at the steps it named."""

    def __init__(self, cfg: FaultsSection, run_dir: str, ctx: WorkerContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.markers = Path(run_dir) / ".faults"

    def _once(self, name: str) -> bool:
        return write_marker(self.markers / name)

    def before_step(self, step: int) -> None:
        """Kill this process hard, or raise, when the run asked for it at ``step``."""
        c, rank = self.cfg, self.ctx.rank
        if c.kill_at_step == step and c.kill_rank == rank and self._once(f"kill_rank{rank}_step{step}"):
            log(f"fault injection: killing rank {rank} (SIGKILL) at step {step}")
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if c.raise_at_step == step and rank == 0 and self._once(f"raise_step{step}"):
            raise InjectedFault(f"fault injection: raise_at_step={step} on rank 0")

    def nan_now(self, step: int) -> bool:
        """True when this rank's loss must become NaN at ``step``."""
        c = self.cfg
        return (
            c.nan_at_step == step and c.nan_rank == self.ctx.rank and self._once(f"nan_rank{self.ctx.rank}_step{step}")
        )

    def oom_now(self, step: int) -> None:
        """At ``oom_at_step`` on rank 0 (once), ask the allocator for far more memory than exists."""
        c = self.cfg
        if c.oom_at_step == step and self.ctx.rank == 0 and self._once(f"oom_step{step}"):
            torch.empty(2**50, dtype=torch.uint8, device=self.ctx.device)  # 1 PiB: a real allocator failure

    def corrupt_latest(self, run_dir: str) -> str | None:
        """Truncate the largest shard of the newest complete checkpoint, once; return its path."""
        if not self.cfg.corrupt_latest_checkpoint or not self.ctx.is_main:
            return None
        newest = latest_complete(run_dir, warn=False)
        if newest is None or not self._once("corrupt_latest_checkpoint"):
            return None
        shards = sorted(Path(newest.path).glob("*.distcp"), key=lambda p: p.stat().st_size)
        victim = shards[-1]
        with open(victim, "r+b") as f:
            f.truncate(max(0, victim.stat().st_size // 2))
        log(f"fault injection: truncated {victim}")
        sys.stdout.flush()
        return newest.path
