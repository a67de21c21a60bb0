"""nrl-flows storage: batches as committed Arrow IPC datasets, and atomic file helpers.

``save_batch(batch, uri, num_shards=1, *, overwrite=False, storage_options=None, **meta)``
writes a ``BatchedDataDict``; ``load_batch(uri, shard=None, ...)`` reads it back. Datasets
live at a local path, ``file://`` or ``s3://`` URI: ``part-*.arrow`` shards and a
``_manifest.json`` written last (the commit). See ``storage.commit`` for the write protocol,
``storage.store`` for reading, ``storage.tensor_codec`` / ``storage.pycodec`` for the column
layouts and ``storage.fs`` for the filesystem helpers shared with checkpoints, metrics and
configs (writes in ``storage.atomic``, re-exported there), and ``storage.retry`` for
the backoff of remote calls that fail transiently (``StorageUnavailableError`` once spent).
Commits are exclusive (``storage.fs.create_only``); ``storage.lease.RunLease`` gives one
writer per run.
"""

from __future__ import annotations

from storage.errors import (
    AlreadyCommittedError,
    CorruptDatasetError,
    MissingShardError,
    NotCommittedError,
)
from storage.fs import (
    check_writable,
    create_only,
    download_dir,
    exists,
    is_s3,
    join,
    list_dir,
    mask_options,
    read_bytes,
    read_text,
    remove,
    resolve,
    upload_dir,
    write_bytes_atomic,
    write_text_atomic,
)
from storage.lease import (
    LeaseHeldError,
    LeaseHolder,
    LeaseLostError,
    LeaseUnreadableError,
    RunLease,
    lease_is_live,
    read_lease,
)
from storage.manifest import MANIFEST_NAME, ColumnSpec, Manifest, ShardInfo
from storage.retry import RetryPolicy, StorageUnavailableError, get_retry_policy, retry_policy, set_retry_policy
from storage.store import (
    delete_batch,
    is_committed,
    list_batches,
    load_batch,
    read_manifest,
    save_batch,
    shard_ranges,
)

__all__ = [
    "MANIFEST_NAME",
    "AlreadyCommittedError",
    "ColumnSpec",
    "CorruptDatasetError",
    "LeaseHeldError",
    "LeaseHolder",
    "LeaseLostError",
    "LeaseUnreadableError",
    "Manifest",
    "MissingShardError",
    "NotCommittedError",
    "RetryPolicy",
    "RunLease",
    "ShardInfo",
    "StorageUnavailableError",
    "check_writable",
    "create_only",
    "delete_batch",
    "download_dir",
    "exists",
    "get_retry_policy",
    "is_committed",
    "is_s3",
    "join",
    "lease_is_live",
    "list_batches",
    "list_dir",
    "load_batch",
    "mask_options",
    "read_bytes",
    "read_lease",
    "read_manifest",
    "read_text",
    "remove",
    "resolve",
    "retry_policy",
    "save_batch",
    "set_retry_policy",
    "shard_ranges",
    "upload_dir",
    "write_bytes_atomic",
    "write_text_atomic",
]
