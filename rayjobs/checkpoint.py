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

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
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
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from rayjobs.context import WorkerContext
from rayjobs.log import log
from rayjobs.storage.local import LocalStore
from rayjobs.storage.store import Store

# The format: a checkpoint is a directory ``checkpoint_<step:08d>``; its manifest (every file's
# sha256 and size) is written last and is its commit marker, on a filesystem and in a bucket.
CHECKPOINT_RE = re.compile(r"^checkpoint_(\d{8})$")
MANIFEST = "manifest.json"
STATE = "state.json"
# Which rank wrote a file of a checkpoint: DCP names its shards ``__<rank>_<n>.distcp``; the RNG
# states are ``rank_<rank>.pt``; the rest (``.metadata``, ``state.json``) is rank 0's.
WRITER_RE = re.compile(r"^(?:__(\d+)[_.]|rank_(\d+)\.pt$)")

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
    best: float | None = None  # training.early_stop: the best value of its metric so far
    evals_since_best: int = 0


@dataclass
class CheckpointInfo:
    """One checkpoint directory as listed by ``rayjobs checkpoints``."""

    path: str
    step: int
    complete: bool
    problem: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    world_size: int | None = None

    @property
    def name(self) -> str:
        """The checkpoint's directory name (``checkpoint_<step>``)."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]


def _distributed(ctx: WorkerContext) -> bool:
    return ctx.world_size > 1 and dist.is_initialized()


def _written_by(name: str, rank: int) -> bool:
    """Whether ``rank`` wrote this file of a checkpoint (and so uploads it)."""
    m = WRITER_RE.match(name)
    return int(m.group(1) or m.group(2)) == rank if m else rank == 0


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


def name_for(step: int) -> str:
    """The directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"checkpoint_{step:08d}"


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def safe_member(name: Any) -> bool:
    """Whether a file name from a manifest stays inside its checkpoint directory (a plain file name)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def as_store(where: str | os.PathLike[str] | Store) -> Store:
    """A run's directory as a Store: a path becomes a LocalStore; a store stays itself."""
    return where if hasattr(where, "dirs") else LocalStore(where)  # type: ignore[return-value]


def checkpoint_names(store: Store) -> list[str]:
    """Names of a run's checkpoint directories, oldest first."""
    return [n for n in store.dirs() if CHECKPOINT_RE.match(n)]


def read_manifest(store: Store, name: str) -> dict[str, Any] | None:
    """A checkpoint's manifest, or None when it has none (incomplete) or it is not JSON."""
    raw = store.read_bytes(f"{name}/{MANIFEST}")
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None


def problem(store: Store, name: str) -> str:
    """What is wrong with a checkpoint ('' when complete): on a filesystem every sha256 is checked
    (``verify``); in a bucket the manifest, every file and its size (the sha256s when it is fetched)."""
    local = store.local_path(name)
    if local is not None:
        return verify(local)
    manifest = read_manifest(store, name)
    if manifest is None:
        return "no manifest in the bucket (the upload did not finish)"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        return "the bucket's manifest is not a mapping of files"
    sizes = manifest.get("sizes", {}) if isinstance(manifest.get("sizes", {}), dict) else {}
    present = store.files(name)
    for file in manifest.get("files", {}):
        if file not in present:
            return f"missing file {file} in the bucket"
        if file in sizes and present[file] != sizes[file]:
            return f"size mismatch in {file} in the bucket"
    return ""


def delete_checkpoint(store: Store, name: str) -> None:
    """Remove one checkpoint: its manifest first, so no reader ever sees it half gone but complete."""
    store.remove(f"{name}/{MANIFEST}")
    store.delete_dir(name)


def fetch(store: Store, name: str, local: Path) -> str:
    """Copy a checkpoint into ``local`` (files already there with the right sha256 are kept).

    Returns '' when the local copy matches the store's manifest, else what is wrong with it.
    """
    manifest = read_manifest(store, name)
    if manifest is None:
        return "no manifest in the bucket"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return "the bucket's manifest has no mapping of files"
    outside = [f for f in files if not safe_member(f)]
    if outside:  # a name like ../../x would be written outside the local copy
        return f"the bucket's manifest names a file outside the checkpoint: {outside[0]!r}"
    local.mkdir(parents=True, exist_ok=True)
    for file, digest in files.items():
        target = local / file
        if target.is_file() and sha256_file(target) == digest:
            continue
        store.download(f"{name}/{file}", target)
        if sha256_file(target) != digest:
            return f"sha256 mismatch in {file} (downloaded from {store.url(name, file)})"
    (local / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return ""


def verify(path: str | Path) -> str:
    """The problem with a checkpoint directory, or '' when it is complete and intact."""
    p = Path(path)
    manifest = p / MANIFEST
    if not manifest.is_file():
        return "no manifest (the save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return f"unreadable manifest: {type(exc).__name__}: {exc}"
    if not isinstance(files, dict) or not all(isinstance(d, str) for d in files.values()):
        return "unreadable manifest: 'files' is not a mapping of file name to sha256"
    for name, digest in files.items():
        if not safe_member(name):
            return f"manifest names a file outside the checkpoint: {name!r}"
        f = p / name
        if not f.is_file():
            return f"missing file {name}"
        if sha256_file(f) != digest:
            return f"sha256 mismatch in {name}"
    return ""


def list_checkpoints(where: str | os.PathLike[str] | Store, check: bool = True) -> list[CheckpointInfo]:
    """Every checkpoint of a run (a directory or a Store), oldest first, with its completeness
    (``check=False``: not verified, each counted complete)."""
    store = as_store(where)
    out = []
    for name in checkpoint_names(store):
        trouble = problem(store, name) if check else ""
        info = CheckpointInfo(store.url(name), int(CHECKPOINT_RE.match(name).group(1)), not trouble, trouble)
        _add_state(info, store.read_bytes(f"{name}/{STATE}"))
        out.append(info)
    return out


def _add_state(info: CheckpointInfo, raw: bytes | None) -> None:
    """Fill a listing's metrics and world size from a checkpoint's state.json (when readable)."""
    try:
        state = json.loads(raw) if raw else {}
    except (ValueError, UnicodeDecodeError):
        return
    if not isinstance(state, dict):
        return
    train = state.get("train") if isinstance(state.get("train"), dict) else {}
    metrics = train.get("metrics", {})
    info.metrics = metrics if isinstance(metrics, dict) else {}
    info.world_size = state.get("world_size")


def list_bucket_checkpoints(store: Store) -> list[CheckpointInfo]:
    """Every checkpoint of a run in an object store, oldest first (``list_checkpoints`` of the store)."""
    return list_checkpoints(store)


def latest_complete(run_dir: str | Path, warn: bool = True) -> CheckpointInfo | None:
    """The newest complete checkpoint; incomplete newer ones are skipped with a warning naming them."""
    for info in reversed(list_checkpoints(run_dir)):
        if info.complete:
            return info
        if warn:
            log(f"warning: skipping checkpoint {info.path}: {info.problem}")
    return None


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


def reconcile_ray_snapshot(run_dir: str | Path, store: Any = None) -> list[str]:
    """Drop the checkpoints we pruned from Ray Train's own list of a run's checkpoints.

    Ray writes ``checkpoint_manager_snapshot.json`` in the run's directory (the bucket's, with an
    object store) naming every reported checkpoint, and its controller refuses to start when one
    of them is gone. rayjobs prunes its checkpoints itself (``keep_last``/``keep_best``), so before
    a re-run with the same name the snapshot is rewritten without the missing ones; a snapshot that
    cannot be read is removed: rayjobs resumes from its own manifests, never from Ray's list.
    Returns the checkpoint names dropped (``["*"]`` when the whole snapshot went).
    """
    store = store if store is not None else LocalStore(run_dir)
    raw = store.read_bytes(RAY_SNAPSHOT)
    if raw is None:
        return []
    try:
        state = json.loads(raw)
        gone = _drop_from_snapshot(state, set(store.dirs()))
    except (ValueError, KeyError, TypeError, AttributeError):
        store.remove(RAY_SNAPSHOT)
        return ["*"]
    if gone:
        store.write_bytes(RAY_SNAPSHOT, json.dumps(state).encode())  # atomic
    return gone


def _drop_from_snapshot(state: dict[str, Any], present: set[str]) -> list[str]:
    """Remove from Ray's snapshot (in place) every checkpoint whose directory is not in ``present``."""
    results = state["checkpoint_results"]
    indices = state["checkpoint_report_indices"]
    gone = [r["checkpoint_dir_name"] for r in results if r["checkpoint_dir_name"] not in present]
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
    return gone


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
        store: Any = None,
        protect: str = "",
        same_buffers: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.protect = os.path.abspath(protect) if protect else ""  # the resume source: never pruned
        # Every rank holds the whole module (no pipeline stages): its buffers are made rank 0's before a save.
        self.same_buffers = same_buffers
        self.store = store  # a storage.RunStore: committed checkpoints are uploaded there too
        self.ctx = ctx
        self.config = config
        self.keep_last, self.keep_best, self.metric, self.mode = keep_last, keep_best, metric, mode
        self.async_save = async_save
        # An async save runs collectives from a background thread: give it its own process group so
        # they never interleave with the training loop's (DDP) collectives on the default group.
        self._async_group = dist.new_group(backend="gloo") if async_save and _distributed(ctx) else None
        # The copy an async save writes from, kept between saves: DCP's default stager allocates a new
        # one per save, and touching fresh memory costs ~3.5x copying into memory already touched
        # (gpt medium on CPU: 0.34 s against 0.09 s). Staging stays synchronous: the next step may
        # change the weights, and a copy made while it runs would mix two steps.
        self._stager = DefaultStager(StagingOptions(False, False, False, False)) if async_save else None
        self._pending: Future | None = None
        self._committed = threading.Event()
        self._pending_error: BaseException | None = None
        self._to_publish: tuple[Path, int] | None = None  # an async save to upload once it is committed
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
            # One rank per directory: rank 0, and with an object store one rank per node (node-local copies).
            if self.ctx.is_main or (self.store is not None and self.ctx.local_rank == 0):
                if path.exists():  # a partial save of an earlier attempt: never mix it with this one
                    shutil.rmtree(path)
                path.mkdir(parents=True)
        except OSError as exc:
            failed = f"{type(exc).__name__}: {exc}"
        if _any_rank(bool(failed), self.ctx):
            self._fail(step, path, failed or "another rank could not write")
        try:
            if self.same_buffers:
                broadcast_buffers(model, self.ctx)
            msd, osd = get_state_dict(model, optimizer, options=FLAT)
            torch.save(rng_state(), path / f"rank_{self.ctx.rank}.pt")
            no_dist = not _distributed(self.ctx)
            if self.async_save and not force_sync:
                future = dcp.async_save(
                    {"model": msd, "optim": osd},
                    checkpoint_id=str(path),
                    no_dist=no_dist,
                    process_group=self._async_group,
                    async_stager=self._stager,
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
        self._to_publish = (path, step) if self.store is not None else None
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
            if self._to_publish is not None:
                (path, step), self._to_publish = self._to_publish, None
                self._publish(path, step)

    def close(self) -> None:
        """Wait for a save in flight, then free the staging copy that async saves reuse (a later
        async save then stages into new memory, as DCP does by default)."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

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
                if self.store is None:
                    self._prune(LocalStore(self.run_dir))
            except OSError as exc:
                failed = f"{type(exc).__name__}: {exc}"
        if _any_rank(bool(failed), self.ctx):
            self._fail(train_state["step"], path, failed or "rank 0 could not commit")
        if self.store is not None:
            self._publish(path, train_state["step"])

    def _commit_async(self, future: Future, path: Path, train_state: dict[str, Any]) -> None:
        try:
            if future.exception() is None:
                self._write_manifest(path, train_state)
                if self.store is None:
                    self._prune(LocalStore(self.run_dir))
        except OSError as exc:
            self._pending_error = exc
        finally:
            self._committed.set()

    def _write_manifest(self, path: Path, train_state: dict[str, Any]) -> None:
        """Commit: every file on disk (fsync), then the manifest written and renamed, then the directory
        entries on disk; only after that may pruning delete older checkpoints (a power loss in between
        leaves the older ones, never an unreadable newest with the rest deleted)."""
        (path / STATE).write_text(json.dumps(train_state, indent=1, sort_keys=True))
        files = {}
        for f in sorted(path.iterdir()):
            if f.is_file() and f.name not in (MANIFEST, f".{MANIFEST}.tmp"):
                fsync_path(f)
                files[f.name] = sha256_file(f)
        tmp = path / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"step": train_state["step"], "files": files}, indent=1, sort_keys=True))
        fsync_path(tmp)
        os.replace(tmp, path / MANIFEST)  # atomic: the checkpoint is complete from here on
        fsync_path(path)  # the rename
        fsync_path(path.parent)  # the checkpoint directory's own entry

    def _keep(self, complete: list[tuple[str, dict[str, float]]]) -> set[str]:
        """Which of the complete checkpoints (name, metrics; oldest first) ``keep_last``/``keep_best`` keep."""
        keep = {n for n, _ in complete[-self.keep_last :]} if self.keep_last > 0 else {n for n, _ in complete}
        if self.keep_best > 0:
            scored = [(n, m) for n, m in complete if self.metric in m]
            scored.sort(key=lambda c: c[1][self.metric], reverse=self.mode == "max")
            keep |= {n for n, _ in scored[: self.keep_best]}
        return keep

    def _prune(self, store: Store) -> set[str]:
        """Delete the committed checkpoints keep_last/keep_best drop (never the resume source); the names kept."""
        committed = [
            c for c in list_checkpoints(store, check=False) if store.read_bytes(f"{c.name}/{MANIFEST}") is not None
        ]
        keep = self._keep([(c.name, c.metrics) for c in committed])
        for c in committed:
            if c.name not in keep and os.path.abspath(c.path) != self.protect:
                delete_checkpoint(store, c.name)
        return keep

    def _publish(self, path: Path, step: int) -> None:
        """Upload a committed checkpoint to the object store (every rank its own files), then its manifest.

        The manifest (sha256 and size of every rank's files) goes up last, from rank 0: the bucket's
        commit marker. Then the bucket is pruned like a directory, and one rank per node drops the
        local copies the bucket no longer keeps.
        """
        from rayjobs.storage.bucket import StoreError

        mine: dict[str, tuple[str, int]] = {}
        failed = ""
        try:
            # Files rank 0 already hashed for the local manifest (this node's) are not read again.
            local = path / MANIFEST
            known = json.loads(local.read_text())["files"] if local.is_file() else {}
            for f in sorted(path.iterdir()):
                if (
                    not f.is_file()
                    or f.name == MANIFEST
                    or f.name.endswith(".tmp")
                    or not _written_by(f.name, self.ctx.rank)
                ):
                    continue
                mine[f.name] = (known.get(f.name) or sha256_file(f), f.stat().st_size)
                self.store.upload(f, f"{path.name}/{f.name}")
        except (OSError, StoreError) as exc:
            failed = str(exc)
        if _any_rank(bool(failed), self.ctx):
            self._fail(step, self.store.url(path.name), failed or "another rank could not upload its files")
        parts: list[Any] = [mine]
        if _distributed(self.ctx):
            parts = [None] * self.ctx.world_size
            dist.all_gather_object(parts, mine)
        kept: list[Any] = [None]
        if self.ctx.is_main:
            files = {n: d for part in parts for n, (d, _) in part.items()}
            sizes = {n: size for part in parts for n, (_, size) in part.items()}
            try:
                manifest = {"step": step, "files": dict(sorted(files.items())), "sizes": dict(sorted(sizes.items()))}
                self.store.write_bytes(f"{path.name}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
                kept = [sorted(self._prune(self.store))]
            except StoreError as exc:
                failed = str(exc)
        if _any_rank(bool(failed), self.ctx):
            self._fail(step, self.store.url(path.name), failed or "rank 0 could not commit it in the bucket")
        if _distributed(self.ctx):
            dist.broadcast_object_list(kept, src=0)
        if self.ctx.local_rank == 0:
            for child in self.run_dir.iterdir():
                if CHECKPOINT_RE.match(child.name) and child.name not in kept[0]:
                    shutil.rmtree(child, ignore_errors=True)

    def _fail(self, step: int, path: Path | str, reason: str) -> None:
        previous = latest_complete(self.run_dir, warn=False)
        kept = f"the previous checkpoint {previous.path} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(f"checkpoint at step {step} not saved to {path}: {reason}; {kept}")


# ---------------------------------------------------------------------------------------------
# Loading.


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def broadcast_buffers(model: nn.Module, ctx: WorkerContext) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics).

    Each rank updates its buffers on its own batches; DDP replaces them with rank 0's at the next
    forward. A save in between would store a mix: DCP writes each replicated tensor once, from
    whichever rank its planner picks, so a resumed run could start from another rank's statistics.
    """
    if not _distributed(ctx):
        return
    from torch.distributed.tensor import DTensor

    for buf in model.buffers():
        if not isinstance(buf, DTensor):
            dist.broadcast(buf.data, src=0)


def saved_config(path: str | Path) -> dict[str, Any]:
    """The resolved config a checkpoint was written with (its ``state.json``); {} when unreadable."""
    try:
        return json.loads((Path(path) / STATE).read_text()).get("config") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def fetch_latest(store: Any, run_dir: str | Path, ctx: WorkerContext) -> str | None:
    """Download the newest complete checkpoint of the object store into ``run_dir``; its local path, or None.

    Rank 0 lists the bucket; one rank per node downloads (files already cached with the right
    sha256 stay); a checkpoint that fails its sha256 on any node is skipped with a warning, like
    an incomplete one, and the next older one is tried. Collective: every rank calls it.
    """
    candidates: list[Any] = [None]
    failed = ""
    if ctx.is_main:
        try:
            names, skipped = [], []
            for name in reversed(checkpoint_names(store)):
                trouble = problem(store, name)
                (skipped.append((name, trouble)) if trouble else names.append(name))
            for name, trouble in skipped:
                log(f"warning: skipping checkpoint {store.url(name)}: {trouble}")
            candidates = [names]
        except Exception as exc:  # noqa: BLE001 - StoreError names the URI
            failed = str(exc)
    if _any_rank(bool(failed), ctx):
        raise CheckpointError(failed or "rank 0 could not list the object store")
    if _distributed(ctx):
        dist.broadcast_object_list(candidates, src=0)
    for name in candidates[0]:
        local = Path(run_dir) / name
        trouble = error = ""
        if ctx.local_rank == 0:
            try:
                trouble = fetch(store, name, local) or verify(local)
            except Exception as exc:  # noqa: BLE001 - an unreachable bucket stops the run: no silent restart from 0
                error = str(exc)
        if _any_rank(bool(error), ctx):
            raise CheckpointError(error or f"another node could not download {store.url(name)}")
        if not _any_rank(bool(trouble), ctx):
            return str(local)
        if trouble:
            log(f"warning: skipping checkpoint {store.url(name)}: {trouble}")
    return None


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


def load_weights(path: str | Path, model: nn.Module, ctx: WorkerContext) -> dict[str, Any]:
    """Only the model weights of a complete checkpoint, into a (possibly wrapped or sharded) model: a warm
    start at any world size and strategy (DCP reshards). Returns the checkpoint's state.json."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    p = Path(path)
    problem = verify(p)
    if problem:
        raise CheckpointError(f"checkpoint {p} is not usable: {problem}")
    weights = get_model_state_dict(model)
    dcp.load({"model": weights}, checkpoint_id=str(p), no_dist=not _distributed(ctx))
    set_model_state_dict(model, weights)
    return json.loads((p / STATE).read_text())


def load_for_inference(
    checkpoint: str | Path, trust_model: str = "", cfg: Any = None, info: Any = None
) -> tuple[nn.Module, Any]:
    """(the model of a checkpoint on CPU in eval mode, its RunConfig): what export, MLflow model logging
    and evaluation load.

    The model is rebuilt from the checkpoint's ``state.json`` (or ``cfg``, a config the caller
    trusts: the run that wrote it): a registry model, or a ``module:callable`` only when the caller
    names that same callable in ``trust_model`` (whoever wrote the checkpoint chose what it names;
    building it runs that code). ``info`` sizes the model when the data's own description is known
    better by the caller (a streamed source); else it comes from the config's dataset.
    """
    from models import build_model
    from models.registry import is_import_path
    from rayjobs import data as data_lib
    from rayjobs.config import from_dict

    p = Path(checkpoint)
    problem = verify(p)
    if problem:
        raise CheckpointError(f"checkpoint {p} is not usable: {problem}")
    if cfg is None:
        raw = saved_config(p)
        named = str((raw.get("model") or {}).get("name", ""))
        if is_import_path(named) and named != trust_model:
            raise CheckpointError(
                f"checkpoint {p} names the model {named!r}, a callable that rebuilding it would run; "
                f"rayjobs runs no code a checkpoint names: if you trust it, pass --trust-model {named}"
            )
        cfg = from_dict(raw)
    info = info or data_lib.data_info(cfg.data.name, cfg.data.kwargs)
    model = build_model(cfg.model.name, cfg.model.flavor, cfg.model.kwargs, info)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(p), no_dist=True)  # in place: into the model's own tensors
    return model.eval(), cfg


def export_weights(checkpoint: str | Path, out: str | Path, trust_model: str = "") -> dict[str, Any]:
    """Write a checkpoint's model weights as a plain state dict (``.pt``) or safetensors file
    (the model as ``load_for_inference`` rebuilds it)."""
    model, cfg = load_for_inference(checkpoint, trust_model)
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    out = Path(out)
    # Written beside the target and renamed into place: a failed write leaves an earlier export whole.
    partial = out.with_name(f".{out.name}.partial")
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as f:  # an unwritable place fails here, with the OS's reason
            if out.suffix != ".safetensors":
                torch.save(weights, f)
        if out.suffix == ".safetensors":  # safetensors writes the file itself, readable by its owner only
            mode = partial.stat().st_mode  # what the user's umask gave the file opened above
            save_file(weights, str(partial))
            partial.chmod(mode)
        os.replace(partial, out)
    except (OSError, RuntimeError, SafetensorError) as exc:  # torch's writer raises RuntimeError (a full disk)
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        reason = getattr(exc, "strerror", None) or str(exc).strip().splitlines()[-1]
        raise CheckpointError(f"cannot write {out}: {reason}; give a path in a directory you can write to") from None
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
