"""Shared storage: every worker must see the run directory the driver made.

On one machine any path works; on a multi-node cluster ``run.storage_path`` must be a filesystem
every node mounts at the same path (NFS, EFS, a ReadWriteMany PVC). The driver writes a mark
into the run directory; each worker reads it before training and, when it cannot, fails at once
with one line that names the node and the path, instead of writing checkpoints nobody can resume.
With an object store (``run.storage_path: s3://...``) the mark goes into the bucket, so the check
proves that every node reaches the bucket with working credentials.
"""

from __future__ import annotations

import os
import platform
import secrets
from pathlib import Path
from typing import Any

from rayjobs.errors import ExplainedFailure

MARK = ".rayjobs-driver"


class StorageNotShared(ExplainedFailure):
    """A worker cannot see the run directory the driver wrote."""


def mark(run_dir: str, store: Any = None) -> str:
    """Write a fresh mark into the run directory, or the bucket's (driver); returns what the workers must read."""
    token = secrets.token_hex(8)
    if store is not None:
        store.write_bytes(MARK, token.encode())
        return token
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    Path(run_dir, MARK).write_text(token)
    return token


def check_shared(run_dir: str, token: str, store: Any = None) -> None:
    """Raise StorageNotShared unless this node reads the driver's mark (worker)."""
    if store is not None:
        try:
            seen = (store.read_bytes(MARK) or b"(not found)").decode()
        except ExplainedFailure as exc:
            seen = f"({exc})"
        if seen != token:
            raise StorageNotShared(
                f"run.storage_path is not reachable: node {platform.node()} ({_ip()}) cannot read {store.url(MARK)} "
                f"that the driver wrote {seen if seen.startswith('(') else '(another run wrote it)'}; give every node "
                "the bucket's credentials (runtime_env env_vars or the node's role) and network access"
            )
        return
    path = Path(run_dir, MARK)
    try:
        seen = path.read_text()
    except OSError as exc:
        seen = f"({exc.strerror or type(exc).__name__})"
    if seen != token:
        raise StorageNotShared(
            f"run.storage_path is not shared: node {platform.node()} ({_ip()}) cannot read {path} that the "
            f"driver wrote {seen if seen.startswith('(') else '(another run wrote it)'}; put run.storage_path on "
            "a filesystem every node mounts at the same path (NFS, EFS, a ReadWriteMany PVC)"
        )


def _ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - only for the message
        return os.environ.get("RAY_NODE_IP_ADDRESS", "?")
