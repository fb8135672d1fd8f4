"""The checkpoint format's names, the same on a filesystem and in a bucket: a leaf.

A checkpoint is a directory ``checkpoint_<step:08d>``; its manifest (``manifest.json``, every
file's sha256 and size) is written last and is its commit marker.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

CHECKPOINT_RE = re.compile(r"^checkpoint_(\d{8})$")
MANIFEST = "manifest.json"


def name_for(step: int) -> str:
    """The directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"checkpoint_{step:08d}"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def safe_member(name: Any) -> bool:
    """Whether a file name from a manifest stays inside its checkpoint directory (a plain file name)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )
