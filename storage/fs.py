"""Filesystem helpers shared by every nrl-flows writer: local paths, ``file://`` and ``s3://``.

The one module callers import (``from storage import fs``). It gathers:

- ``storage.filesystems``: how a URI maps to an fsspec filesystem (:func:`resolve`), URI
  helpers, S3 configuration from ``storage_options`` or the AWS environment, credentials
  masking, and retries of transient remote failures (``storage.retry``);
- ``storage.atomic``: writes a reader never sees half of (:func:`write_bytes_atomic`,
  :func:`write_text_atomic`), exclusive commits (:func:`create_only`) and :func:`remove`;

and holds the queries (``exists``, ``check_writable``, ``list_dir``, ``walk_files``,
``read_bytes``, ``read_text``) and the directory copies (``upload_dir``, ``download_dir``).

s3fs caches directory listings per filesystem instance; every query here that depends on
what exists (``exists``, ``list_dir``, ``walk_files``) drops the cache for its path first, so
writes by other processes are seen.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Any, Mapping

from storage.atomic import (
    TMP_MARKER,
    _unlink_quiet,
    commit_local,
    create_only,
    fsync_dir,
    is_temp_name,
    local_temp_path,
    remove,
    write_bytes_atomic,
    write_text_atomic,
)
from storage.filesystems import (
    _LOCAL,
    RetryingFileSystem,
    invalidate_cache,
    is_local,
    is_s3,
    join,
    mask_options,
    resolve,
    s3_options,
)

__all__ = [
    "TMP_MARKER",
    "RetryingFileSystem",
    "check_writable",
    "create_only",
    "download_dir",
    "exists",
    "fsync_dir",
    "invalidate_cache",
    "is_local",
    "is_s3",
    "is_temp_name",
    "join",
    "list_dir",
    "mask_options",
    "read_bytes",
    "read_text",
    "remove",
    "resolve",
    "s3_options",
    "upload_dir",
    "walk_files",
    "write_bytes_atomic",
    "write_text_atomic",
]


# --------------------------------------------------------------------------- queries
def exists(uri: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether a file or directory (prefix) exists at ``uri`` (fresh, not from a cache)."""
    fs, path = resolve(uri, storage_options)
    invalidate_cache(fs, path)
    if is_s3(uri) and "/" not in path:  # s3fs answers False for a bucket when the endpoint is down
        try:
            fs.call_s3("head_bucket", Bucket=path)
        except FileNotFoundError:
            return False
        return True
    return bool(fs.exists(path))


def check_writable(uri: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> None:
    """Prove that files can be created under ``uri`` by writing and deleting a small probe.

    A real write, not a permission-bit check (root ignores those; S3 policies are invisible).
    Raises ``PermissionError`` (or the filesystem's ``OSError``) naming ``uri``.
    """
    probe = join(uri, f".nrl-write-probe{TMP_MARKER}{uuid.uuid4().hex[:12]}")
    try:
        write_bytes_atomic(probe, b"nrl write probe\n", storage_options)
    except OSError as exc:
        if isinstance(exc, PermissionError) or exc.errno in (13, 30):  # EACCES, EROFS
            raise PermissionError(f"{uri} is not writable: {exc.strerror or exc}") from None
        raise
    remove(probe, storage_options=storage_options)


def list_dir(
    uri: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """Sorted names (not paths) of the direct children of ``uri``; ``[]`` when it is missing.

    Temp files of unfinished atomic writes are left out. Directories count as children;
    local disks and SeaweedFS keep emptied directories, plain S3 forgets empty prefixes, so
    callers looking for complete entries should check for their commit marker.
    """
    fs, path = resolve(uri, storage_options)
    invalidate_cache(fs, path)
    try:
        entries = fs.ls(path, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    names = {e.rstrip("/").rsplit("/", 1)[-1] for e in entries}
    names.discard("")
    return sorted(n for n in names if not is_temp_name(n))


def walk_files(
    uri: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> list[str]:
    """Sorted paths, relative to ``uri`` with ``/`` separators, of every file below it."""
    fs, path = resolve(uri, storage_options)
    invalidate_cache(fs, path)
    try:
        found = fs.find(path)
    except FileNotFoundError:
        return []
    prefix = path.rstrip("/") + "/"
    return sorted(p[len(prefix) :] for p in found if p.startswith(prefix))


def read_bytes(uri: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The whole content of one file."""
    fs, path = resolve(uri, storage_options)
    if fs is _LOCAL:
        with open(path, "rb") as f:
            return f.read()
    return fs.cat_file(path)


def read_text(
    uri: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    encoding: str = "utf-8",
) -> str:
    """The whole content of one text file."""
    return read_bytes(uri, storage_options).decode(encoding)



# --------------------------------------------------------------------------- directories
def upload_dir(
    local_dir: str | os.PathLike[str],
    uri: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Copy every file below ``local_dir`` to ``uri`` (same relative paths); returns them.

    Each file lands atomically, but the directory as a whole does not: writers that need a
    commit write a marker file (e.g. a manifest) last, after this returns.
    """
    src = os.path.abspath(os.fspath(local_dir))
    if not os.path.isdir(src):
        raise NotADirectoryError(f"upload_dir: {src} is not a directory")
    rels = []
    for root, _dirs, files in os.walk(src):
        for name in files:
            rels.append(os.path.relpath(os.path.join(root, name), src).replace(os.sep, "/"))
    rels.sort()
    fs, path = resolve(uri, storage_options)
    if fs is _LOCAL:
        for rel in rels:
            dst = os.path.join(path, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            tmp = local_temp_path(dst)
            try:
                shutil.copyfile(os.path.join(src, rel), tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                commit_local(tmp, dst, durable=False)
            except BaseException:
                _unlink_quiet(tmp)
                raise
        for d in {os.path.dirname(os.path.join(path, r)) for r in rels}:
            fsync_dir(d)
        return rels
    if rels:
        fs.put([os.path.join(src, r) for r in rels], [f"{path}/{r}" for r in rels])
    invalidate_cache(fs, path)
    return rels


def download_dir(
    uri: str | os.PathLike[str],
    local_dir: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Copy every file below ``uri`` into ``local_dir`` (created); returns the relative paths.

    Files are fetched into a temp directory next to ``local_dir`` and then renamed into
    place, so an interrupted download never leaves a partial file under its final name.
    """
    rels = walk_files(uri, storage_options)
    if not rels:
        if not exists(uri, storage_options):
            raise FileNotFoundError(f"download_dir: nothing at {uri}")
    dst = os.path.abspath(os.fspath(local_dir))
    os.makedirs(dst, exist_ok=True)
    fs, path = resolve(uri, storage_options)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}{TMP_MARKER}", dir=os.path.dirname(dst))
    try:
        if rels:
            lpaths = [os.path.join(staging, r) for r in rels]
            for lp in lpaths:
                os.makedirs(os.path.dirname(lp), exist_ok=True)
            fs.get([f"{path}/{r}" for r in rels], lpaths)
        for rel in rels:
            final = os.path.join(dst, rel)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(os.path.join(staging, rel), final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return rels
