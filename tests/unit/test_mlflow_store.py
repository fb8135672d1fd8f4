"""A new sqlite MLflow store is a copy of an empty one that MLflow's own migrations built once."""

from __future__ import annotations

import contextlib
import sqlite3

from rayjobs import mlflow_store
from rayjobs.tracking import client


def schema(db) -> list[tuple[str, list[str]]]:
    """Each table's and index's SQL, its lines sorted (MLflow's own stores list constraints in either order)."""
    with contextlib.closing(sqlite3.connect(db)) as con:
        rows = con.execute("SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'").fetchall()
    return sorted((name, sorted(line.strip(" ,") for line in (sql or "").splitlines())) for name, sql in rows)


def test_a_seeded_store_is_what_mlflow_makes_and_mlflow_fills_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    made_by_mlflow = tmp_path / "mlflow-made.db"
    from mlflow import MlflowClient

    MlflowClient(f"sqlite:///{made_by_mlflow}").search_experiments()

    seeded = tmp_path / "store" / "mlflow.db"  # in a folder not made yet, which MLflow would make too
    c = client(f"sqlite:///{seeded}")
    assert (tmp_path / "cache" / "rayjobs").is_dir() and seeded.exists()
    assert schema(seeded) == schema(made_by_mlflow)
    experiments = {e.name: e for e in c.search_experiments()}
    assert set(experiments) == {"Default"}
    assert experiments["Default"].experiment_id == "0"
    assert experiments["Default"].artifact_location == str(tmp_path / "mlruns" / "0")  # MLflow's, not the cache's
    run = c.create_run(c.create_experiment("rayjobs")).info
    c.log_metric(run.run_id, "val/accuracy", 0.5, step=1)

    # A store that is there is never replaced: not by a second seed, nor by another client.
    assert mlflow_store.seed(seeded) is False
    again = client(f"sqlite:///{seeded}")
    assert again.get_run(run.run_id).data.metrics == {"val/accuracy": 0.5}
    assert not list(seeded.parent.glob(".*seed"))
    mlflow_store.seed_uri(f"sqlite:///{tmp_path / 'q.db'}?timeout=30")  # SQLAlchemy's file is q.db: left to MLflow
    assert not list(tmp_path.glob("q.db*"))


def test_without_a_cache_to_write_mlflow_makes_the_store_itself(tmp_path, monkeypatch):
    """No cache to keep the empty store in: MLflow makes the store as it always did."""
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    db = tmp_path / "mlflow.db"
    assert mlflow_store.seed(db) is False and not db.exists()
    c = client(f"sqlite:///{db}")
    assert [e.name for e in c.search_experiments()] == ["Default"] and db.exists()
