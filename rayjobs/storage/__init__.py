"""Where a run's files live: a filesystem path or an object store bucket.

    uri.py      storage locations: path or ``s3://...`` URI (pure checks, a leaf)
    format.py   the checkpoint format's names: directory names, manifest, sha256 (a leaf)
    bucket.py   RunStore: one run's directory in an object store, through pyarrow
    mark.py     the driver's mark that every worker must read (shared storage)

``rayjobs.checkpoint`` writes and reads the format on top of these.
"""

from rayjobs.storage.bucket import RunStore, StoreError
from rayjobs.storage.mark import StorageNotShared, check_shared, mark
from rayjobs.storage.uri import cache_dir_for, check_uri, is_uri

__all__ = ["RunStore", "StorageNotShared", "StoreError", "cache_dir_for", "check_shared", "check_uri", "is_uri", "mark"]
