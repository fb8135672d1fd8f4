"""Every path of a run config made absolute once, on the driver, before it crosses the Ray boundary.

Ray Train starts its workers in a session directory of its own, so a relative path means a
different place in every process. ``resolve(cfg)`` is called where a config is loaded for a
driver (``load_config``); the worker then refuses any relative path (``require_absolute``)
instead of resolving it against its own working directory.

Under ``ray job submit`` the driver runs inside a copy of the ``--working-dir`` that Ray deletes
after the job: a relative ``run.storage_path`` (results outlive the job) goes to
``~/ray_results/<path>`` on the node that runs the driver, Ray's own default, and the console
says so. Data paths stay relative to the working directory (the data was uploaded with it).
"""

from __future__ import annotations

import os
from typing import Any

from rayjobs.config import HF_PREFIX
from rayjobs.errors import ExplainedFailure

RAY_RESULTS = "~/ray_results"
DATA_PATH_KEYS = ("path", "val_path", "test_path")
FILE_URI_PREFIXES = ("sqlite:///", "file://")


class RelativePath(ExplainedFailure):
    """A config path reached a worker unresolved (a driver that skipped ``resolve``)."""


def in_ray_job() -> bool:
    """True when this process is the entrypoint of a ``ray job submit`` job (its cwd is Ray's copy)."""
    # The job supervisor sets this for the entrypoint only (Ray's own workers never see it).
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def durable(path: str, what: str) -> tuple[str, str | None]:
    """(absolute path, a note for the console or None): relative paths under a Ray job go to ~/ray_results."""
    expanded = os.path.expanduser(path)
    if os.path.isabs(expanded):
        return os.path.normpath(expanded), None
    if in_ray_job():
        target = os.path.normpath(os.path.join(os.path.expanduser(RAY_RESULTS), expanded))
        return target, (
            f"{what} {path!r} is relative and this driver runs in a Ray job's working-dir copy, which Ray "
            f"deletes after the job: it goes to {target} on this node instead (give an absolute path on shared "
            "storage for a multi-node cluster)"
        )
    return os.path.abspath(expanded), None


def resolve(cfg: Any) -> list[str]:
    """Make every path in ``cfg`` absolute, in place; returns the notes the console should print."""
    from rayjobs.storage.uri import is_uri

    notes: list[str] = []
    run = cfg.run
    if not is_uri(run.storage_path):
        run.storage_path, note = durable(run.storage_path, "run.storage_path")
        notes += [note] if note else []
    if run.local_dir:
        run.local_dir, note = durable(run.local_dir, "run.local_dir")
        notes += [note] if note else []
    kwargs = dict(cfg.data.kwargs)
    for key in DATA_PATH_KEYS:
        if isinstance(kwargs.get(key), str) and kwargs[key] and not is_uri(kwargs[key]):
            kwargs[key] = os.path.abspath(os.path.expanduser(kwargs[key]))
    if kwargs != cfg.data.kwargs:
        cfg.data.kwargs = kwargs
    if cfg.checkpoint.resume_from and not is_uri(cfg.checkpoint.resume_from):
        cfg.checkpoint.resume_from = os.path.abspath(os.path.expanduser(cfg.checkpoint.resume_from))
    if cfg.model.init_from and ":/" not in cfg.model.init_from:  # a path, not runs:/ or models:/
        cfg.model.init_from = os.path.abspath(os.path.expanduser(cfg.model.init_from))
    if cfg.model.name.startswith(HF_PREFIX):  # hf:<dir>, read by every worker
        cfg.model.name = HF_PREFIX + os.path.abspath(os.path.expanduser(cfg.model.name.removeprefix(HF_PREFIX)))
    cfg.tracking.uri = _absolute_file_uri(cfg.tracking.uri)
    return notes


def _absolute_file_uri(uri: str) -> str:
    """``sqlite:///rel.db`` and ``file://rel`` name a path relative to the cwd: make it absolute."""
    for prefix in FILE_URI_PREFIXES:
        if uri.startswith(prefix):
            rest = uri[len(prefix) :]
            return uri if rest.startswith("/") else prefix + os.path.abspath(os.path.expanduser(rest))
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return "file:" + os.path.abspath(uri[len("file:") :])
    return uri


def relative_paths(cfg: Any) -> list[str]:
    """Config paths that are still relative: none once ``resolve`` ran."""
    from rayjobs.storage.uri import is_uri

    found = []
    if not is_uri(cfg.run.storage_path) and not os.path.isabs(cfg.run.storage_path):
        found.append(f"run.storage_path={cfg.run.storage_path!r}")
    if cfg.run.local_dir and not os.path.isabs(cfg.run.local_dir):
        found.append(f"run.local_dir={cfg.run.local_dir!r}")
    for key in DATA_PATH_KEYS:
        value = cfg.data.kwargs.get(key)
        if isinstance(value, str) and value and not is_uri(value) and not os.path.isabs(value):
            found.append(f"data.kwargs.{key}={value!r}")
    resume = cfg.checkpoint.resume_from
    if resume and not is_uri(resume) and not os.path.isabs(resume):
        found.append(f"checkpoint.resume_from={resume!r}")
    if cfg.model.name.startswith(HF_PREFIX) and not os.path.isabs(cfg.model.name.removeprefix(HF_PREFIX)):
        found.append(f"model.name={cfg.model.name!r}")
    return found


def require_absolute(cfg: Any) -> None:
    """In a worker: every config path must already be absolute (the driver resolves them)."""
    found = relative_paths(cfg)
    if found:
        raise RelativePath(
            f"relative path(s) reached a worker, whose working directory is Ray's: {', '.join(found)}; "
            "load the config with rayjobs.config.load_config (it resolves paths on the driver) or give absolute paths"
        )


def summary_path(path: str) -> tuple[str, str | None]:
    """Where ``--summary PATH`` goes: absolute; under a Ray job a relative one goes to ~/ray_results too."""
    return durable(path, "--summary")
