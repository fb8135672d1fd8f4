"""Where a run's files live: a filesystem path or an object store bucket.

    uri.py      storage locations: path or ``s3://...`` URI (pure checks, a leaf)
    store.py    the Store protocol: the files and directories of one run
    local.py    LocalStore: a run's directory on a filesystem
    bucket.py   RunStore: the same protocol in an object store, through pyarrow
    mark.py     the driver's mark that every worker must read (shared storage)

``rayjobs.checkpoint`` owns the checkpoint format and works through a Store: one code path for a
directory and a bucket.
"""

from rayjobs.storage.bucket import RunStore, StoreError
from rayjobs.storage.local import LocalStore
from rayjobs.storage.mark import StorageNotShared, check_shared, mark
from rayjobs.storage.store import Store
from rayjobs.storage.uri import cache_dir_for, check_uri, is_uri

__all__ = [
    "LocalStore",
    "RunStore",
    "Store",
    "StorageNotShared",
    "StoreError",
    "cache_dir_for",
    "check_shared",
    "check_uri",
    "is_uri",
    "mark",
]
