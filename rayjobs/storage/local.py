"""LocalStore: one run's directory on a filesystem (shared by every node on a cluster), a ``Store``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


class LocalStore:
    """One run's directory on a filesystem (shared by every node on a cluster)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.root = Path(run_dir)

    def url(self, *parts: str) -> str:
        """The path of ``parts``."""
        return str(self.root.joinpath(*parts))

    def local_path(self, rel: str) -> Path | None:
        """The path of ``rel``."""
        return self.root / rel

    def dirs(self) -> list[str]:
        """Directory names, sorted."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def files(self, rel: str) -> dict[str, int]:
        """Plain files of ``rel`` with their sizes."""
        d = self.root / rel
        return {p.name: p.stat().st_size for p in d.iterdir() if p.is_file()} if d.is_dir() else {}

    def read_bytes(self, rel: str) -> bytes | None:
        """The bytes of ``rel``, or None."""
        p = self.root / rel
        return p.read_bytes() if p.is_file() else None

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write through a temporary file and an atomic rename."""
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, p)

    def upload(self, local: Path, rel: str) -> None:
        """Copy ``local`` into the run's directory (nothing when it is that file already)."""
        target = self.root / rel
        if Path(local).resolve() != target.resolve():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local, target)

    def download(self, rel: str, local: Path) -> None:
        """Copy ``rel`` out of the run's directory."""
        shutil.copyfile(self.root / rel, local)

    def remove(self, rel: str) -> None:
        """Unlink ``rel`` if it is there."""
        (self.root / rel).unlink(missing_ok=True)

    def delete_dir(self, rel: str) -> None:
        """``rm -r`` of ``rel`` (errors ignored: a concurrent prune may have taken it)."""
        shutil.rmtree(self.root / rel, ignore_errors=True)
