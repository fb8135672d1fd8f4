"""Checks made on the driver before Ray starts: packages a config needs, its data source, the
checkpoint it resumes from, and the memory one rank will hold. Each problem is one line."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from typing import Any

from rayjobs.errors import ConfigError

# (config field, the value that needs it) -> (module to import, the pip requirement that brings it)
OPTIONAL_PACKAGES: dict[tuple[str, str], tuple[str, str]] = {
    ("tune.search", "optuna"): ("optuna", "optuna"),
    ("data.name", "parquet"): ("pyarrow", "pyarrow"),
    ("data.name", "csv"): ("pyarrow", "pyarrow"),
    ("data.name", "images"): ("PIL", "pillow"),
}


def _value(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def missing_packages(cfg: Any, fields: tuple[str, ...] = ("data.name", "tune.search")) -> list[str]:
    """One line per optional package that ``cfg`` needs (among ``fields``) and this Python cannot import."""
    problems = []
    for (field, value), (module, requirement) in OPTIONAL_PACKAGES.items():
        if field in fields and _value(cfg, field) == value and importlib.util.find_spec(module) is None:
            problems.append(
                f"{field}: {value} needs the package {requirement!r}, which is not installed; pip install {requirement}"
            )
    return problems


def check_writable_dir(path: str, field: str = "run.storage_path") -> None:
    """Create ``path`` (a run's or a search's directory) now, or say in one line why it cannot be.

    An object store URI is left to its store. Without this, a path under a missing mount, inside
    a file or on a read-only disk failed as a traceback (a search's only after Ray had started).
    """
    if "://" in path:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{field}: cannot create {path}: {exc.strerror or exc}; give a directory you can write to"
        ) from None
    try:  # a real write: os.access says yes to root on a read-only mount or in /proc
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{field}: {path} is not writable ({exc.strerror or exc}); give a directory you can write to"
        ) from None


def check_data(cfg: Any) -> Any:
    """A streamed dataset's source, checked before Ray starts (None for in-memory datasets)."""
    from rayjobs import data as data_lib
    from rayjobs import parallel

    if not data_lib.is_streaming(cfg.data.name):
        check_validation_rows(cfg)
        return None
    from rayjobs.ray_data import DataError

    if cfg.parallel.tp > 1 or cfg.parallel.pp > 1 or parallel.strategy(cfg.parallel.strategy).model_parallel:
        raise ConfigError(
            f"data.name={cfg.data.name} streams a different shard to every worker; tensor and pipeline "
            f"parallel ranks need the same batches: use parallel.strategy ddp, fsdp or hsdp"
        )
    try:
        return data_lib.spec(cfg.data.name).load(**cfg.data.kwargs)
    except DataError as exc:
        raise ConfigError(str(exc)) from None


EMPTY_PARAMETERS = "optimizer got an empty parameter list"  # torch.optim.Optimizer's, after its subclass's checks


def check_optimizer(cfg: Any) -> None:
    """The optimizer must take ``optim.kwargs``: an unknown or bad argument (``betas: [0.9, 1.5]``, ``lr``
    given twice) is one line before Ray, not every worker's error.

    torch's own optimizers check their arguments before their parameters, so they are built over no
    parameters and stop at torch's empty-list error: a parameter would make torch import
    ``torch._dynamo`` (about 1 s of the driver's time before Ray starts). A user's optimizer, and the
    arguments torch checks after the parameters (``fused``, ``foreach``, ``differentiable``), get a
    2x2 layer."""
    from torch import nn

    from rayjobs.stepping import build_optimizer

    o = cfg.optim
    torchs_own = o.name in ("adamw", "sgd") or o.name.startswith("torch.optim.")
    if torchs_own and not {"fused", "foreach", "differentiable"} & set(o.kwargs):
        try:
            build_optimizer(nn.Module(), cfg)
        except ValueError as exc:
            if str(exc) == EMPTY_PARAMETERS:
                return
        except Exception:  # noqa: BLE001, S110 - said below, by the build over a layer
            pass
    # A user's optimizer, or an error (or a torch whose empty-list message reads otherwise): over a layer.
    try:
        build_optimizer(nn.Linear(2, 2), cfg)
    except OSError:  # the machine's (a vanished working directory), not the optimizer's arguments
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the optimizer (maybe a user's) raises on these arguments
        where = "optim.kwargs: {} cannot be built with them" if o.kwargs else "optim.name: {} cannot be built"
        raise ConfigError(f"{where.format(o.name)}: {type(exc).__name__}: {exc}") from None


def check_model_builds(cfg: Any) -> None:
    """A registered model must build with its flavor and ``model.kwargs``: built here on the meta device (no
    memory), so ``n_heads: 3`` for a width of 32 is one line before Ray, not every worker's error. A
    user's or a transformers model is left to the memory estimate: it may not run on the meta device."""
    from models import get_spec, model_names
    from rayjobs.data import data_info
    from rayjobs.parallel import meta_model

    m = cfg.model
    if m.name not in model_names():
        return
    try:
        meta_model(cfg)
    except OSError:  # the machine's (a vanished working directory), not the model's arguments
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the model's constructor raises on these arguments
        shape = tuple(data_info(cfg.data.name, cfg.data.kwargs).input_shape)
        built = f"{m.name} (flavor {m.flavor or get_spec(m.name).default_flavor}{f', {m.kwargs}' if m.kwargs else ''})"
        raise ConfigError(
            f"{'model.kwargs' if m.kwargs else 'model.name'}: {built} cannot be built for inputs {shape} of "
            f"data.name={cfg.data.name}: {type(exc).__name__}: {exc}"
        ) from None


def check_validation_rows(cfg: Any) -> None:
    """An in-memory dataset's validation split must hold a row: it picks the best checkpoint, drives early
    stopping and Tune's metric, and an empty one failed every worker after training (an empty test split
    only means no test metrics)."""
    from rayjobs import data as data_lib

    try:
        empty = data_lib.train_rows(cfg.data.name, cfg.data.kwargs, "val") == 0
    except Exception:  # noqa: BLE001 - a user's loader that fails says so itself (check_train_rows, the worker)
        return
    if empty:
        own = "val_fraction" in (data_lib.accepted_kwargs(data_lib.spec(cfg.data.name).load) or [])
        field, fix = ("data.kwargs.val_fraction", "set e.g. 0.1") if own else ("data.name", "return rows in it")
        raise ConfigError(
            f"{field}: the validation split of {cfg.data.name} is empty, and it picks the best checkpoint and "
            f"drives early stopping; {fix}"
        )


def check_train_rows(
    cfg: Any, source: Any, world_size: int, batch_size: int | None = None, field: str = "training.batch_size"
) -> int | None:
    """The training split must hold a full batch for every data-parallel replica: a run that could take
    no step is one line here, not an error in every worker after Ray started. ``source``: a streamed
    dataset's (rows from file metadata); None for in-memory data, counted here (the bundled sets, and a
    user's, which the driver loads once anyway). ``batch_size``: a value to check in place of the config's, named ``field`` in the error.
    Returns the optimizer steps of one epoch (None where the rows cannot be counted here)."""
    from rayjobs import data as data_lib
    from rayjobs import parallel
    from rayjobs.stepping import micro_batch_size

    t = cfg.training.model_copy(update={"batch_size": batch_size}) if batch_size else cfg.training
    if source is not None:
        if "train" not in source.rows:
            return None
        rows, replicas = source.rows["train"], world_size
    else:
        try:
            rows = data_lib.train_rows(cfg.data.name, cfg.data.kwargs)
        except Exception:  # noqa: BLE001 - a user's loader that fails says so itself, in the worker
            return None
        replicas = parallel.resolve_layout(cfg.parallel, world_size).dp
    micro_batch = micro_batch_size(t.batch_size, replicas, t.grad_accum)
    steps_per_epoch = rows // replicas // micro_batch // t.grad_accum
    if steps_per_epoch == 0:
        where = cfg.data.kwargs.get("path") or cfg.data.name
        who = f"{replicas} worker(s)" if replicas == world_size else f"{replicas} data-parallel replica(s)"
        fits = rows // replicas // t.grad_accum * replicas * t.grad_accum
        fix = f"lower {field} to at most {fits}, or give more data" if fits else "give more data"
        raise ConfigError(
            f"{field}: {t.batch_size} rows a step, but {where} holds {rows} training row(s) for "
            f"{who}, not one full batch; {fix}"
        )
    return steps_per_epoch


def note_max_steps_past_the_end(cfg: Any, steps_per_epoch: int | None) -> None:
    """``training.max_steps`` only stops a run early: one past the epochs' end is said, not ignored."""
    t = cfg.training
    if steps_per_epoch and t.max_steps > steps_per_epoch * t.epochs:
        from rayjobs import log

        log.note(
            f"training.max_steps={t.max_steps} is past the run's end: training.epochs={t.epochs} makes "
            f"{steps_per_epoch * t.epochs} steps, and the run stops there (raise training.epochs to train longer)"
        )


def check_resume_from(cfg: Any) -> None:
    """An explicit ``checkpoint.resume_from`` must be a complete checkpoint (checked before Ray starts)."""
    if not cfg.checkpoint.resume_from:
        return
    import os

    from rayjobs.checkpoint import verify

    path = os.path.abspath(cfg.checkpoint.resume_from)
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint.resume_from: no checkpoint directory at {path}")
    problem = verify(path)
    if problem:
        raise ConfigError(f"checkpoint.resume_from: {path} is not a complete checkpoint: {problem}")
    from rayjobs.resume import incompatible_checkpoint

    # The first start resumes from it, later ones from their own newest (a bucket's: rank 0 checks).
    if "://" not in cfg.storage_path and newest_committed(cfg.run_dir) is None:
        problem = incompatible_checkpoint(path, cfg)
        if problem:
            raise ConfigError(f"checkpoint.resume_from: {problem.removeprefix('error: ')}")
    cfg.checkpoint.resume_from = path


def newest_committed(run_dir: str) -> str | None:
    """The run directory's newest checkpoint with a manifest (committed), found without hashing its
    files: rank 0 verifies them when it resumes, and hashing them here too would double that."""
    from pathlib import Path

    from rayjobs.checkpoint import MANIFEST, list_checkpoints

    committed = [c.path for c in list_checkpoints(run_dir, check=False) if (Path(c.path) / MANIFEST).is_file()]
    return committed[-1] if committed else None


def check_own_checkpoints(cfg: Any, store: Any) -> None:
    """The same command again resumes from the run directory's newest checkpoint: one of another
    model or dataset is refused here, in one line, instead of in every worker after Ray started
    (only its state.json is read)."""
    if cfg.checkpoint.resume_from or store is not None:  # a resume source, or the bucket's newest (checked by rank 0)
        return
    from rayjobs.resume import incompatible_checkpoint

    newest = newest_committed(cfg.run_dir)
    problem = incompatible_checkpoint(newest, cfg) if newest else ""
    if problem:
        raise ConfigError(problem.removeprefix("error: "))
    if newest:
        from rayjobs import checkpoint, log

        changes = config_changes(checkpoint.saved_config(newest), cfg.model_dump(mode="json"))
        if changes:
            shown = ", ".join(changes[:6]) + (f" and {len(changes) - 6} more" if len(changes) > 6 else "")
            log.note(
                f"run {cfg.run.name} continues from {os.path.basename(newest)} with a changed config: {shown}; "
                "a new run.name starts a new run"
            )


# What a run's checkpoints were trained under; its name, storage, tracking and fault drills may change freely.
TRAINED_UNDER = ("model", "data", "task", "optim", "training", "parallel", "scaling", "checkpoint")


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"optim.lr 0.003 -> 0.01"`` for each field of ``TRAINED_UNDER`` that differs between a checkpoint's
    saved config and this start's (both ``model_dump(mode="json")``); [] for a config saved before them."""

    def leaves(node: Any, prefix: str) -> dict[str, Any]:
        if isinstance(node, dict):  # an empty mapping (no model.kwargs) has no leaves
            return {k: v for key, value in node.items() for k, v in leaves(value, f"{prefix}.{key}").items()}
        return {prefix: node}

    changes = []
    for section in TRAINED_UNDER:
        if section not in saved:
            continue
        before, after = leaves(saved[section], section), leaves(current.get(section), section)
        for key in sorted(set(before) | set(after)):
            if key != "checkpoint.resume_from" and before.get(key) != after.get(key):
                changes.append(f"{key} {before.get(key, '(unset)')} -> {after.get(key, '(unset)')}")
    return changes


def check_init_from(cfg: Any) -> str:
    """``model.init_from`` as a local checkpoint directory of the same model (checked before Ray starts):
    a path, ``runs:/RUN_ID`` (the checkpoint its model was logged from) or ``models:/NAME/VERSION|latest|@ALIAS``."""
    source = cfg.model.init_from
    if not source:
        return ""
    import os

    from rayjobs.checkpoint import saved_config, verify

    if source.startswith(MLFLOW_SOURCES):
        from rayjobs.tracking import tracking_uri

        path = mlflow_checkpoint(tracking_uri(cfg), source, "model.init_from")
    else:
        path = source
    if not os.path.isdir(path):
        raise ConfigError(f"model.init_from: no checkpoint directory at {path}")
    problem = verify(path)
    if problem:
        raise ConfigError(f"model.init_from: {path} is not a complete checkpoint: {problem}")
    model = saved_config(path).get("model") or {}
    theirs = (model.get("name"), model.get("flavor"), model.get("kwargs") or {})
    if theirs != (cfg.model.name, cfg.model.flavor, cfg.model.kwargs):
        raise ConfigError(
            f"model.init_from: {source} holds {theirs[0]}/{theirs[1]} {theirs[2]}, but this run builds "
            f"{cfg.model.name}/{cfg.model.flavor} {cfg.model.kwargs}: warm-start the same model"
        )
    return path


MLFLOW_SOURCES = ("runs:/", "models:/")


def mlflow_checkpoint(uri: str, source: str, what: str) -> str:
    """The checkpoint directory that ``runs:/RUN_ID`` or ``models:/NAME/VERSION|latest|@ALIAS`` was logged from
    (its run's ``rayjobs.model_checkpoint`` tag) in the MLflow store at ``uri``; ``what`` names the
    argument in the one-line error."""
    from mlflow import MlflowClient

    from rayjobs.errors import first_line
    from rayjobs.tracking import MODEL_CHECKPOINT_TAG

    name, _, version = source.removeprefix("models:/").partition("/")
    if source.startswith("models:/") and "@" not in name and version not in ("", "latest") and not version.isdigit():
        raise ConfigError(
            f"{what}: {source}: a model version is a number or 'latest' (stages are gone in MLflow 3); "
            f"for an alias write models:/{name}@ALIAS"
        )
    client = MlflowClient(uri)
    try:
        if source.startswith("models:/"):
            if "@" in name:
                name, alias = name.split("@", 1)
                run_id = client.get_model_version_by_alias(name, alias).run_id
            elif version in ("", "latest"):
                run_id = _latest_model_version(client, name).run_id
            else:
                run_id = client.get_model_version(name, version).run_id
        else:
            run_id = source.removeprefix("runs:/").split("/", 1)[0]
        tags = client.get_run(run_id).data.tags
    except Exception as exc:  # noqa: BLE001 - an unknown name, version or run is the user's to fix
        raise ConfigError(f"{what}: {source} not found in {uri}: {first_line(exc)}") from None
    if MODEL_CHECKPOINT_TAG not in tags:
        raise ConfigError(f"{what}: MLflow run {run_id} ({source}) logged no rayjobs checkpoint")
    return tags[MODEL_CHECKPOINT_TAG]


def _latest_model_version(client: Any, name: str) -> Any:
    """The registered model's highest version (``models:/NAME/latest``, or ``models:/NAME``)."""
    versions = client.search_model_versions(f"name = '{name}'") if "'" not in name else []
    if not versions:
        raise LookupError(f"no registered model named {name!r} (or it has no version)")
    return max(versions, key=lambda v: int(v.version))


def memory_estimate(cfg: Any, world_size: int, use_gpu: bool) -> float | None:
    """Print what one rank will hold (parameters, gradients, optimizer state, activations); return the total."""
    from models.registry import NotAModule, is_import_path
    from rayjobs import log, parallel
    from rayjobs.memory import estimate

    layout = parallel.resolve_layout(cfg.parallel, world_size)
    try:
        est = estimate(cfg, layout, use_gpu)
    except NotAModule as exc:  # on any device: say so before Ray starts, not in every worker
        raise ConfigError(f"model.name: {exc}; the callable must build and return the model") from None
    except Exception as exc:  # noqa: BLE001 - a user's model may not run on the meta device
        if is_import_path(cfg.model.name):
            check_users_model_on_the_cpu(cfg)
        log.note(f"no memory estimate ({cfg.model.name} does not run on the meta device: {exc})")
        return None
    log.note(est.format(layout))
    return est.total


def check_users_model_on_the_cpu(cfg: Any) -> None:
    """A user's model that failed on the meta device is built on the CPU and run on one sample (eval
    mode, no gradients). Where it fails there too, its arguments or its data's shape are wrong: one
    line before Ray, where it was a traceback from every worker. Where it works, the meta device was
    the trouble, and the run goes on without a memory estimate."""
    import torch

    from models import build_model
    from rayjobs.data import data_info

    m, data = cfg.model, cfg.data
    info = data_info(data.name, data.kwargs)
    called = f"{m.name}({', '.join(f'{k}={v!r}' for k, v in m.kwargs.items())})"
    try:
        model = build_model(m.name, m.flavor, m.kwargs, info)
    except Exception as exc:  # noqa: BLE001 - whatever the user's builder raises on these arguments
        field = "model.kwargs" if m.kwargs else "model.name"
        raise ConfigError(f"{field}: {called} fails: {type(exc).__name__}: {exc}") from None
    x = torch.zeros((1, *info.input_shape), dtype=torch.long if info.kind == "tokens" else torch.float32)
    model.eval()
    try:
        with torch.no_grad():
            model(x)
    except Exception as exc:  # noqa: BLE001 - the user's forward on the data's shape
        raise ConfigError(
            f"model.name: {called} fails on one sample of data.name={data.name} (inputs {tuple(info.input_shape)}): "
            f"{type(exc).__name__}: {exc}"
        ) from None
