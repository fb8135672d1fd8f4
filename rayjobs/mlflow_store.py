"""A new sqlite MLflow store, copied from an empty one instead of migrated from nothing.

MLflow makes a new sqlite store by running every schema migration (about 1.9 s here, paid by each
new storage path: each first run, each test's store, `rayjobs ui` on a new place); opening an
existing one takes 0.05 s. So the first store is migrated once per MLflow version into the user's
cache (``~/.cache/rayjobs``), its Default experiment taken out, and each new store is a copy of it:
MLflow then makes the Default experiment itself, with this store's artifact location.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
from importlib.metadata import version
from pathlib import Path


def cache_dir() -> Path:
    """Where the empty store is kept: ``$XDG_CACHE_HOME/rayjobs``, else ``~/.cache/rayjobs``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rayjobs"


def empty_store() -> Path:
    """The empty store of the installed MLflow (built on first use, by MLflow's own migrations)."""
    template = cache_dir() / f"mlflow-{version('mlflow')}-empty.db"
    if template.exists():
        return template
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    template.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=template.parent, prefix=".building-") as d:
        db = Path(d, "mlflow.db")
        SqlAlchemyStore(f"sqlite:///{db}", default_artifact_root=Path(d, "artifacts").as_uri()).engine.dispose()
        with contextlib.closing(sqlite3.connect(db)) as con, con:
            con.execute("DELETE FROM experiments WHERE experiment_id = 0")  # each copy makes its own
        os.replace(db, template)  # whole or not at all; builders at the same time make the same file
    return template


def seed(db_path: str | os.PathLike[str]) -> bool:
    """Make the sqlite store at ``db_path`` from the empty store where there is none yet; True if made.

    Never over a store another process made meanwhile (a hard link fails where the name is taken).
    Where the copy cannot be made (no hard links on this file system, no cache to write), MLflow
    makes the store as it always does.
    """
    db = Path(db_path)
    if db.exists():
        return False
    copy = db.with_name(f".{db.name}.{os.getpid()}.seed")
    try:
        db.parent.mkdir(parents=True, exist_ok=True)  # as MLflow does for a new sqlite file
        shutil.copyfile(empty_store(), copy)
        os.link(copy, db)
        return True
    except Exception:  # noqa: BLE001 - a faster start only: MLflow makes the store, or says why it cannot
        return False
    finally:
        copy.unlink(missing_ok=True)


def seed_uri(uri: str) -> None:
    """``seed`` the file of an ``sqlite:///ABS/PATH.db`` tracking URI; other URIs (and one with query
    arguments, whose file name SQLAlchemy reads without them) are left alone."""
    if uri.startswith("sqlite:///") and "?" not in uri:
        seed(uri[len("sqlite:///") :])
