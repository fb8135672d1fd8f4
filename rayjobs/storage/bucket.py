"""A run's checkpoints in an object store (``s3://``, ``gs://``, ``abfs://``, ``hdfs://``) through pyarrow.

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

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rayjobs.errors import ExplainedFailure
from rayjobs.storage.format import CHECKPOINT_RE, MANIFEST, safe_member, sha256_file


class StoreError(ExplainedFailure):
    """The object store cannot be reached, read or written; the message names the URI and the fix."""


def open_filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path inside it) for a storage URI; StoreError in one line when it cannot be opened."""
    import pyarrow.fs as pafs

    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds; the message says which
        raise StoreError(f"run.storage_path {uri}: cannot open it: {_first_line(exc)}") from None
    return fs, path.rstrip("/")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class RunStore:
    """One run's directory in an object store: ``<storage URI>/<run name>``."""

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
            f"object store: cannot {what} {self.url(rel) if rel else self.url()}: {_first_line(exc)}; check the endpoint and the "
            "credentials in this node's environment"
        )

    def check(self) -> None:
        """Reach the bucket once (list the run's directory): StoreError in one line when it cannot."""
        self.checkpoint_names()

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

    def delete(self, name: str) -> None:
        """Remove one checkpoint directory (its manifest first, so no reader sees it half gone as complete)."""
        import pyarrow.fs as pafs

        try:
            if self.fs.get_file_info(self.path(name, MANIFEST)).type == pafs.FileType.File:
                self.fs.delete_file(self.path(name, MANIFEST))
            self.fs.delete_dir(self.path(name))
        except Exception as exc:  # noqa: BLE001
            raise self._wrap("delete", name, exc) from None

    def checkpoint_names(self) -> list[str]:
        """Names of the checkpoint directories in the bucket, oldest first."""
        import pyarrow.fs as pafs

        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except Exception as exc:  # noqa: BLE001
            raise self._wrap("list", "", exc) from None
        names = [i.base_name for i in infos if i.type == pafs.FileType.Directory and CHECKPOINT_RE.match(i.base_name)]
        return sorted(names)

    def manifest(self, name: str) -> dict[str, Any] | None:
        """A checkpoint's manifest from the bucket, or None when it has none (incomplete)."""
        raw = self.read_bytes(f"{name}/{MANIFEST}")
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None

    def problem(self, name: str) -> str:
        """What is wrong with a checkpoint in the bucket ('' when its manifest and every file are there, sizes matching)."""
        import pyarrow.fs as pafs

        manifest = self.manifest(name)
        if manifest is None:
            return "no manifest in the bucket (the upload did not finish)"
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
            return "the bucket's manifest is not a mapping of files"
        sizes = manifest.get("sizes", {}) if isinstance(manifest.get("sizes", {}), dict) else {}
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.path(name)))
        except Exception as exc:  # noqa: BLE001
            raise self._wrap("list", name, exc) from None
        present = {i.base_name: i.size for i in infos if i.type == pafs.FileType.File}
        for file in manifest.get("files", {}):
            if file not in present:
                return f"missing file {file} in the bucket"
            if file in sizes and present[file] != sizes[file]:
                return f"size mismatch in {file} in the bucket"
        return ""

    def fetch(self, name: str, local: Path) -> str:
        """Download a checkpoint into ``local`` (files already there with the right sha256 are kept).

        Returns '' when the local copy matches the bucket's manifest, else what is wrong with it.
        """
        manifest = self.manifest(name)
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
            tmp = local / f".{file}.part"
            try:
                with self.fs.open_input_stream(self.path(name, file)) as src, open(tmp, "wb") as dst:
                    for chunk in iter(lambda: src.read(8 << 20), b""):
                        dst.write(chunk)
            except Exception as exc:  # noqa: BLE001
                raise self._wrap("download", f"{name}/{file}", exc) from None
            os.replace(tmp, target)
            if sha256_file(target) != digest:
                return f"sha256 mismatch in {file} (downloaded from {self.url(name, file)})"
        (local / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        return ""
