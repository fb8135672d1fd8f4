"""Checkpoints that resume exactly: DCP shards, per-rank RNG state, a manifest written last.

Layout of one checkpoint, inside the run's directory (``<storage_path>/<run.name>``)::

    checkpoint_00000120/
      .metadata, __0_0.distcp, ...   model + optimizer, written by every rank in parallel (DCP)
      rank_0.pt, rank_1.pt, ...      each rank's RNG states (python, numpy, torch CPU and CUDA)
      state.json                     step, epoch, position in the epoch, world size, scheduler,
                                     grad scaler, loss window, metrics, the resolved config
      manifest.json                  sha256 of every file above; written last: the commit marker

A checkpoint without a manifest, or whose files do not match it, is incomplete and never loaded.
Nothing here unpickles code: tensors load with ``weights_only=True`` and the rest is JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from rayjobs.parallel import WorkerContext

MANIFEST = "manifest.json"
STATE = "state.json"
CHECKPOINT_RE = re.compile(r"^checkpoint_(\d{8})$")

# DCP warns when it saves or loads in one process; in local mode that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# Optimizer state keyed per parameter (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): pipeline
# stages hold different parameters, and a per-group list would collide across ranks in DCP.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names what and where."""


@dataclass
class TrainState:
    """Where the loop is: enough to continue at the exact step inside the epoch."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    loss_sum: float = 0.0  # train losses since the last report (the report's mean)
    loss_count: int = 0
    samples: int = 0
    data_wait_s: float = 0.0  # time the loop waited for its next batches
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class CheckpointInfo:
    """One checkpoint directory as listed by ``rayjobs checkpoints``."""

    path: str
    step: int
    complete: bool
    problem: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    world_size: int | None = None


def name_for(step: int) -> str:
    """The directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"checkpoint_{step:08d}"


def _log(message: str) -> None:
    sys.stdout.write(f"[rayjobs] {message}\n")
    sys.stdout.flush()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _distributed(ctx: WorkerContext) -> bool:
    return ctx.world_size > 1 and dist.is_initialized()


def _barrier(ctx: WorkerContext) -> None:
    if ctx.world_size > 1 and dist.is_initialized():
        dist.barrier()


def _any_rank(flag: bool, ctx: WorkerContext) -> bool:
    """True on every rank when ``flag`` is true on any rank (also a barrier)."""
    if ctx.world_size == 1 or not dist.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# ---------------------------------------------------------------------------------------------
# RNG state of one rank, as tensors and plain values (loadable with weights_only=True).


def rng_state() -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch CPU and (when present) CUDA."""
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(v) for v in internal.tolist()), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# Inspection: is a checkpoint complete, which is the newest complete one.


def verify(path: str | Path) -> str:
    """The problem with a checkpoint directory, or '' when it is complete and intact."""
    p = Path(path)
    manifest = p / MANIFEST
    if not manifest.is_file():
        return "no manifest (the save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as exc:
        return f"unreadable manifest: {exc}"
    for name, digest in files.items():
        f = p / name
        if not f.is_file():
            return f"missing file {name}"
        if _sha256(f) != digest:
            return f"sha256 mismatch in {name}"
    return ""


def list_checkpoints(run_dir: str | Path, check: bool = True) -> list[CheckpointInfo]:
    """Every checkpoint directory of a run, oldest first, with its completeness."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    out = []
    for child in sorted(root.iterdir()):
        m = CHECKPOINT_RE.match(child.name)
        if not m or not child.is_dir():
            continue
        problem = verify(child) if check else ""
        info = CheckpointInfo(str(child), int(m.group(1)), complete=not problem, problem=problem)
        state_file = child / STATE
        if state_file.is_file():
            try:
                state = json.loads(state_file.read_text())
                info.metrics = state.get("train", {}).get("metrics", {})
                info.world_size = state.get("world_size")
            except ValueError:
                pass
        out.append(info)
    return out


def latest_complete(run_dir: str | Path, warn: bool = True) -> CheckpointInfo | None:
    """The newest complete checkpoint; incomplete newer ones are skipped with a warning naming them."""
    for info in reversed(list_checkpoints(run_dir)):
        if info.complete:
            return info
        if warn:
            _log(f"warning: skipping checkpoint {info.path}: {info.problem}")
    return None


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


def reconcile_ray_snapshot(run_dir: str | Path) -> list[str]:
    """Drop the checkpoints we pruned from Ray Train's own list of a run's checkpoints.

    Ray writes ``checkpoint_manager_snapshot.json`` in the run's directory naming every reported
    checkpoint, and its controller refuses to start when one of them is gone. rayjobs prunes its
    checkpoints itself (``keep_last``/``keep_best``), so before a re-run with the same name the
    snapshot is rewritten without the missing ones (atomically); a snapshot that cannot be read
    is removed: rayjobs resumes from its own manifests, never from Ray's list. Returns the
    checkpoint names dropped (``["*"]`` when the whole snapshot went).
    """
    path = Path(run_dir) / RAY_SNAPSHOT
    if not path.is_file():
        return []
    try:
        state = json.loads(path.read_text())
        results = state["checkpoint_results"]
        indices = state["checkpoint_report_indices"]
        names = [r["checkpoint_dir_name"] for r in results]
        gone = [n for n in names if not (Path(run_dir) / n).is_dir()]
        if not gone:
            return []
        kept = [(r, i) for r, i in zip(results, indices, strict=True) if r["checkpoint_dir_name"] not in gone]
        state["checkpoint_results"] = [r for r, _ in kept]
        state["checkpoint_report_indices"] = [i for _, i in kept]
        latest = state.get("latest_checkpoint_result")
        if latest is not None and latest["checkpoint_dir_name"] in gone:
            state["latest_checkpoint_result"] = kept[-1][0] if kept else None
        pending = list(zip(state["pending_training_results"], state["pending_validation_specs"], strict=True))
        pending = [(r, v) for r, v in pending if r["checkpoint_dir_name"] not in gone]
        state["pending_training_results"] = [r for r, _ in pending]
        state["pending_validation_specs"] = [v for _, v in pending]
        for key, value in state.items():
            if key.endswith("_checkpoint_dir_names"):
                state[key] = [n for n in value if n not in gone]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)
        return gone
    except (ValueError, KeyError, TypeError, AttributeError):
        path.unlink()
        return ["*"]


# ---------------------------------------------------------------------------------------------
# Saving.


class Saver:
    """Writes checkpoints of one run (sync or async), commits them with a manifest, prunes old ones."""

    def __init__(
        self,
        run_dir: str,
        ctx: WorkerContext,
        config: dict[str, Any],
        keep_last: int,
        keep_best: int = 0,
        metric: str = "val/loss",
        mode: str = "min",
        async_save: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.ctx = ctx
        self.config = config
        self.keep_last, self.keep_best, self.metric, self.mode = keep_last, keep_best, metric, mode
        self.async_save = async_save
        # An async save runs collectives from a background thread: give it its own process group so
        # they never interleave with the training loop's (DDP) collectives on the default group.
        self._async_group = dist.new_group(backend="gloo") if async_save and _distributed(ctx) else None
        self._pending: Future | None = None
        self._committed = threading.Event()
        self._pending_error: BaseException | None = None
        self.blocked_s: list[float] = []  # time the training loop was blocked per save

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: Any,
        state: TrainState,
        force_sync: bool = False,
    ) -> str | None:
        """Save after ``step`` steps. Returns the path once committed (sync), None while async."""
        self.wait()
        path = self.run_dir / name_for(step)
        started = time.perf_counter()
        failed = ""
        try:
            if self.ctx.is_main:
                if path.exists():  # a partial save of an earlier attempt: never mix it with this one
                    shutil.rmtree(path)
                path.mkdir(parents=True)
        except OSError as exc:
            failed = f"{type(exc).__name__}: {exc}"
        if _any_rank(bool(failed), self.ctx):
            self._fail(step, path, failed or "another rank could not write")
        try:
            msd, osd = get_state_dict(model, optimizer, options=FLAT)
            torch.save(rng_state(), path / f"rank_{self.ctx.rank}.pt")
            no_dist = not _distributed(self.ctx)
            if self.async_save and not force_sync:
                future = dcp.async_save(
                    {"model": msd, "optim": osd},
                    checkpoint_id=str(path),
                    no_dist=no_dist,
                    process_group=self._async_group,
                )
            else:
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path), no_dist=no_dist)
                future = None
        except Exception as exc:  # noqa: BLE001 - every storage error is reported the same way
            failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if _any_rank(bool(failed), self.ctx):
            self._fail(step, path, failed or "another rank could not write its shard")
        train_state = self._state_json(step, scheduler, scaler, state)
        if future is None:
            self._commit(path, train_state)
            self.blocked_s.append(time.perf_counter() - started)
            return str(path)
        self._pending = future
        self._committed = threading.Event()
        if self.ctx.is_main:
            future.add_done_callback(lambda f: self._commit_async(f, path, train_state))
        else:
            self._committed.set()
        self.blocked_s.append(time.perf_counter() - started)
        return None

    def wait(self) -> None:
        """Block until an async save in flight is committed; raise if it failed."""
        if self._pending is not None:
            try:
                self._pending.result()
            except Exception as exc:  # noqa: BLE001
                self._pending_error = exc
            self._committed.wait()  # rank 0's manifest is written in the future's callback
            self._pending = None
            _barrier(self.ctx)
            if self._pending_error is not None:
                err, self._pending_error = self._pending_error, None
                raise CheckpointError(f"async checkpoint save failed: {type(err).__name__}: {err}") from err

    def _state_json(self, step: int, scheduler: Any, scaler: Any, state: TrainState) -> dict[str, Any]:
        sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
        return {
            "step": step,
            "world_size": self.ctx.world_size,
            "train": asdict(state),
            "scheduler": sched,
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else {},
            "config": self.config,
            "saved_at": time.time(),
        }

    def _commit(self, path: Path, train_state: dict[str, Any]) -> None:
        _barrier(self.ctx)  # every rank's shard and RNG file is on disk
        failed = ""
        if self.ctx.is_main:
            try:
                self._write_manifest(path, train_state)
                self._prune()
            except OSError as exc:
                failed = f"{type(exc).__name__}: {exc}"
        if _any_rank(bool(failed), self.ctx):
            self._fail(train_state["step"], path, failed or "rank 0 could not commit")

    def _commit_async(self, future: Future, path: Path, train_state: dict[str, Any]) -> None:
        try:
            if future.exception() is None:
                self._write_manifest(path, train_state)
                self._prune()
        except OSError as exc:
            self._pending_error = exc
        finally:
            self._committed.set()

    def _write_manifest(self, path: Path, train_state: dict[str, Any]) -> None:
        (path / STATE).write_text(json.dumps(train_state, indent=1, sort_keys=True))
        files = {f.name: _sha256(f) for f in sorted(path.iterdir()) if f.is_file() and f.name != MANIFEST}
        tmp = path / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"step": train_state["step"], "files": files}, indent=1, sort_keys=True))
        os.replace(tmp, path / MANIFEST)  # atomic: the checkpoint is complete from here on

    def _prune(self) -> None:
        complete = [c for c in list_checkpoints(self.run_dir, check=False) if (Path(c.path) / MANIFEST).is_file()]
        keep = {c.path for c in complete[-self.keep_last :]} if self.keep_last > 0 else {c.path for c in complete}
        if self.keep_best > 0:
            scored = [c for c in complete if self.metric in c.metrics]
            scored.sort(key=lambda c: c.metrics[self.metric], reverse=self.mode == "max")
            keep |= {c.path for c in scored[: self.keep_best]}
        for c in complete:
            if c.path not in keep:
                shutil.rmtree(c.path, ignore_errors=True)

    def _fail(self, step: int, path: Path, reason: str) -> None:
        previous = latest_complete(self.run_dir, warn=False)
        kept = f"the previous checkpoint {previous.path} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(f"checkpoint at step {step} not saved to {path}: {reason}; {kept}")


# ---------------------------------------------------------------------------------------------
# Loading.


def load(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ctx: WorkerContext,
    scheduler: Any = None,
    scaler: Any = None,
) -> dict[str, Any]:
    """Load a complete checkpoint into model (and optimizer, scheduler, scaler); return its state.json.

    DCP reshards to this world size. RNG states are restored only when the world size matches
    (ranks then map one to one); otherwise each rank keeps its fresh seed and says so.
    """
    p = Path(path)
    problem = verify(p)
    if problem:
        raise CheckpointError(f"checkpoint {p} is not usable: {problem}")
    state = json.loads((p / STATE).read_text())
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer, options=FLAT)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(p), no_dist=not _distributed(ctx))
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=FLAT)
    else:
        sd = {"model": model.state_dict()}
        dcp.load(sd, checkpoint_id=str(p), no_dist=not _distributed(ctx))
        model.load_state_dict(sd["model"])
    if scheduler is not None and state.get("scheduler"):
        scheduler.load_state_dict({**scheduler.state_dict(), **state["scheduler"]})
    if scaler is not None and scaler.is_enabled() and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    rank_file = p / f"rank_{ctx.rank}.pt"
    if state.get("world_size") == ctx.world_size and rank_file.is_file():
        set_rng_state(torch.load(rank_file, weights_only=True))
    return state


def export_weights(checkpoint: str | Path, out: str | Path) -> dict[str, Any]:
    """Write a checkpoint's model weights as a plain state dict (``.pt``) or safetensors file."""
    from models import build_model
    from rayjobs import data as data_lib
    from rayjobs.config import from_dict

    p = Path(checkpoint)
    problem = verify(p)
    if problem:
        raise CheckpointError(f"checkpoint {p} is not usable: {problem}")
    cfg = from_dict(json.loads((p / STATE).read_text())["config"])
    splits = data_lib.load(cfg.data.name, cfg.data.kwargs)
    model = build_model(cfg.model.name, cfg.model.flavor, cfg.model.kwargs, splits.info)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(p), no_dist=True)
    weights = {k: v.detach().contiguous() for k, v in sd["model"].items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(weights, str(out))
    else:
        torch.save(weights, out)
    return {
        "model": cfg.model.name,
        "flavor": cfg.model.flavor,
        "tensors": len(weights),
        "parameters": int(sum(v.numel() for v in weights.values())),
    }


def write_marker(path: Path) -> bool:
    """Create ``path`` once; False when it already existed (for faults that fire only once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True
