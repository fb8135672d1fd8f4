"""A run's directory in an object store (``s3://``, ``gs://``, ``abfs://``, ``hdfs://``) through pyarrow:
the Store protocol (``rayjobs.storage.store``) on a bucket.

When ``run.storage_path`` is such a URI, every node works in a node-local directory
(``run.local_dir``: logs, the MLflow spool, a cache of checkpoints) and the bucket holds what must
outlive a node: each committed checkpoint, Ray Train's own state, and the driver's storage mark.

A checkpoint reaches the bucket file by file, each rank uploading the files it wrote, and its
manifest last (with every file's sha256 and size): as on a filesystem, a checkpoint whose manifest
is not in the bucket is incomplete and never loaded. Resuming downloads the newest complete one into
the local cache and checks every sha256 before loading. Credentials come from the environment
(``AWS_*``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_*``), never from the URI; the
endpoint and region may ride in its query (``s3://b/p?endpoint_override=host:port&scheme=http``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rayjobs.errors import ExplainedFailure, first_line


class StoreError(ExplainedFailure):
    """The object store cannot be reached, read or written; the message names the URI and the fix."""


def open_filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path inside it) for a storage URI; StoreError in one line when it cannot be opened."""
    import pyarrow.fs as pafs

    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds; the message says which
        raise StoreError(f"run.storage_path {uri}: cannot open it: {first_line(exc)}") from None
    return fs, path.rstrip("/")


class RunStore:
    """One run's directory in an object store: ``<storage URI>/<run name>`` (a ``Store``)."""

    def __init__(self, uri: str, run_name: str) -> None:
        self.uri = uri
        self.fs, self.base = open_filesystem(uri)
        self.root = f"{self.base}/{run_name}"
        self._scheme = urlsplit(uri).scheme

    def path(self, *parts: str) -> str:
        """The filesystem path (no scheme) of ``parts`` inside the run's directory."""
        return "/".join([self.root, *parts])

    def url(self, *parts: str) -> str:
        """A readable URL of ``parts`` inside the run's directory (for messages and summaries)."""
        return f"{self._scheme}://{self.path(*parts)}"

    def _wrap(self, what: str, rel: str, exc: BaseException) -> StoreError:
        return StoreError(
            f"object store: cannot {what} {self.url(rel) if rel else self.url()}: {first_line(exc)}; check the endpoint and the "
            "credentials in this node's environment"
        )

    def check(self) -> None:
        """Reach the bucket once (list the run's directory): StoreError in one line when it cannot."""
        self.dirs()

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write one object (whole)."""
        try:
            with self.fs.open_output_stream(self.path(rel)) as f:
                f.write(data)
        except Exception as exc:  # noqa: BLE001
            raise self._wrap("write", rel, exc) from None

    def read_bytes(self, rel: str) -> bytes | None:
        """One object's bytes, or None when it does not exist."""
        import pyarrow.fs as pafs

        try:
            if self.fs.get_file_info(self.path(rel)).type != pafs.FileType.File:
                return None
            with self.fs.open_input_stream(self.path(rel)) as f:
                return f.read()
        except Exception as exc:  # noqa: BLE001
            raise self._wrap("read", rel, exc) from None

    def upload(self, local: Path, rel: str) -> None:
        """Copy one local file to ``rel``."""
        try:
            with open(local, "rb") as src, self.fs.open_output_stream(self.path(rel)) as dst:
                for chunk in iter(lambda: src.read(8 << 20), b""):
                    dst.write(chunk)
        except Exception as exc:  # noqa: BLE001
            raise self._wrap("upload to", rel, exc) from None

    def download(self, rel: str, local: Path) -> None:
        """Copy ``rel`` to a local file (through ``<local>.part`` and a rename)."""
        tmp = local.with_name(f".{local.name}.part")
        try:
            with self.fs.open_input_stream(self.path(rel)) as src, open(tmp, "wb") as dst:
                for chunk in iter(lambda: src.read(8 << 20), b""):
                    dst.write(chunk)
        except Exception as exc:  # noqa: BLE001
            raise self._wrap("download", rel, exc) from None
        os.replace(tmp, local)

    def local_path(self, rel: str) -> Path | None:
        """None: a bucket is remote."""
        return None

    def dirs(self) -> list[str]:
        """Directory names in the run's directory, sorted."""
        return sorted(self._listing("", want_dirs=True))

    def files(self, rel: str) -> dict[str, int]:
        """Plain files of ``rel`` with their sizes."""
        return self._listing(rel, want_dirs=False)

    def _listing(self, rel: str, want_dirs: bool) -> dict[str, int]:
        import pyarrow.fs as pafs

        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.path(rel) if rel else self.root, allow_not_found=True))
        except Exception as exc:  # noqa: BLE001
            raise self._wrap("list", rel, exc) from None
        kind = pafs.FileType.Directory if want_dirs else pafs.FileType.File
        return {i.base_name: i.size for i in infos if i.type == kind}

    def remove(self, rel: str) -> None:
        """Delete one object if it is there."""
        import pyarrow.fs as pafs

        try:
            if self.fs.get_file_info(self.path(rel)).type == pafs.FileType.File:
                self.fs.delete_file(self.path(rel))
        except Exception as exc:  # noqa: BLE001
            raise self._wrap("delete", rel, exc) from None

    def delete_dir(self, rel: str) -> None:
        """Delete a directory and its objects."""
        try:
            self.fs.delete_dir(self.path(rel))
        except Exception as exc:  # noqa: BLE001
            raise self._wrap("delete", rel, exc) from None
