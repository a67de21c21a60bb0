"""A run's storage root: checked before anything starts, normalised so every process agrees on it."""

from __future__ import annotations

import os
from typing import Any

from storage import fs

__all__ = ["check_storage_root", "normalize_root"]


def _fs():
    return fs


def normalize_root(root: str) -> str:
    """Absolute local paths (actors may run with another cwd); URIs unchanged."""
    if "://" in root and not root.startswith("file://"):
        return root.rstrip("/") or root
    path = root[len("file://") :] if root.startswith("file://") else root
    return os.path.abspath(os.path.expanduser(path))


def check_storage_root(root: str, storage_options: dict[str, Any] | None = None, *, create: bool = True) -> str:
    """Validate a storage root before anything starts; return it normalised.

    Local: the directory exists or (``create``) can be created, and (``create``) is writable.
    ``create=False`` is for commands that only read a root or write inside runs that exist
    (``nrl runs``, ``nrl eval``, ``nrl resume``): nothing is created or written, and a missing
    root is an error. ``s3://bucket/prefix``: the bucket is reachable. Anything else:
    ``ValueError`` naming the URI.
    """
    if not isinstance(root, str) or not root.strip():
        raise ValueError("storage root is empty")
    scheme = root.split("://", 1)[0] if "://" in root else ""
    if scheme not in ("", "file", "s3", "s3a"):
        raise ValueError(f"storage root {root!r}: unsupported scheme {scheme!r} (use a local path, file:// or s3://)")
    if scheme in ("s3", "s3a"):
        bucket = root.split("://", 1)[1].split("/", 1)[0]
        if not bucket:
            raise ValueError(f"storage root {root!r} names no bucket (use s3://bucket[/prefix])")
        if len(bucket) < 3:
            raise ValueError(f"storage root {root!r}: invalid bucket name {bucket!r}")
        norm = normalize_root(root)
        try:
            ok = _fs().exists(f"{scheme}://{bucket}", storage_options=storage_options)
        except Exception as exc:  # noqa: BLE001 - endpoint down, credentials, ...
            raise ValueError(f"storage root {root!r} is not reachable: {type(exc).__name__}: {exc}") from None
        if not ok:
            raise ValueError(f"storage root {root!r}: bucket {bucket!r} does not exist")
        return norm
    norm = normalize_root(root)
    if not create:
        if not os.path.isdir(norm):
            what = "is not a directory" if os.path.exists(norm) else "does not exist"
            raise ValueError(f"storage root {root!r} {what}")
        return norm
    try:
        os.makedirs(norm, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"storage root {root!r} cannot be created: {exc.strerror or exc}") from None
    if not os.path.isdir(norm):
        raise ValueError(f"storage root {root!r} is not a directory")
    try:  # a real write: permission bits say nothing when running as root or on read-only mounts
        _fs().check_writable(norm)
    except OSError as exc:
        raise ValueError(f"storage root {root!r} is not writable: {exc}") from None
    return norm
