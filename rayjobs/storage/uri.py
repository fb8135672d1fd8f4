"""Storage locations: a filesystem path or an object store URI (``s3://``, ``gs://``, ``abfs://``, ``hdfs://``).

Pure string checks, no network: a leaf that imports nothing of rayjobs.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "hdfs")


def is_uri(path: str) -> bool:
    """True for a ``scheme://`` storage location rather than a filesystem path."""
    return "://" in path


def check_uri(uri: str) -> None:
    """Raise ValueError naming what is wrong with a storage URI (no network access); never echoes a secret."""
    parts = urlsplit(uri)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"object store URIs must start with {', '.join(s + '://' for s in SCHEMES)}, got {uri!r}")
    if "@" in parts.netloc:
        shown = parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]).geturl()
        raise ValueError(
            "must not carry credentials (user:secret@): set them in the environment (AWS_ACCESS_KEY_ID, "
            f"GOOGLE_APPLICATION_CREDENTIALS, ...) so they are never logged, got {shown!r}"
        )
    if not parts.netloc:
        raise ValueError(f"names no bucket (write {parts.scheme}://BUCKET/PREFIX), got {uri!r}")


def cache_dir_for(uri: str) -> str:
    """The default node-local working directory for a storage URI: ``~/.cache/rayjobs/<scheme>/<bucket>/<prefix>``."""
    parts = urlsplit(uri)
    tail = re.sub(r"[^A-Za-z0-9._/-]", "_", f"{parts.netloc}/{parts.path.strip('/')}").strip("/")
    return os.path.join(os.path.expanduser("~/.cache/rayjobs"), parts.scheme, tail)
