"""The Store protocol: one run's directory, on a filesystem (``local.LocalStore``) or in a bucket
(``bucket.RunStore``).

A store knows files and directories, nothing of checkpoints: ``rayjobs.checkpoint`` owns the
format (names, manifest, sha256) and lists, verifies, prunes and reconciles through this one
interface, so local and bucket runs share one code path. A leaf: imports nothing of rayjobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Store(Protocol):
    """What checkpoint code needs of a run's directory. ``rel`` paths are relative to the run's directory."""

    def url(self, *parts: str) -> str:
        """A readable location of ``parts`` (a path, or ``s3://...``) for messages and summaries."""

    def local_path(self, rel: str) -> Path | None:
        """``rel`` on this machine's filesystem, or None when the store is remote."""

    def dirs(self) -> list[str]:
        """Names of the directories in the run's directory, sorted (none when it does not exist)."""

    def files(self, rel: str) -> dict[str, int]:
        """The plain files in directory ``rel``: name -> size in bytes."""

    def read_bytes(self, rel: str) -> bytes | None:
        """A file's bytes, or None when it does not exist."""

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write a whole file (readers see the old content or the new, never a part)."""

    def upload(self, local: Path, rel: str) -> None:
        """Copy a local file to ``rel``."""

    def download(self, rel: str, local: Path) -> None:
        """Copy ``rel`` to a local file."""

    def remove(self, rel: str) -> None:
        """Remove one file (nothing when it is not there)."""

    def delete_dir(self, rel: str) -> None:
        """Remove a directory and everything in it."""
