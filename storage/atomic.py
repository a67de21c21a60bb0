"""Writes a reader never sees half of, exclusive (create-only) writes, and removal.

How a file is written so that a reader sees the old content or all of the new:

- local: a temp file in the same directory (``.<name>.tmp-<random>``), ``fsync``, ``os.replace``,
  then ``fsync`` of the directory;
- S3: a single PUT (or a multipart upload completed at the end); S3 makes an object visible
  only once it is complete, so the object itself is the commit.

:func:`create_only` is the exclusive variant every commit marker uses (batch manifests, run
leases): of concurrent creators of one path exactly one wins (local: temp file + ``os.link``;
S3: a PUT with ``If-None-Match: *``). :func:`remove` deletes files and prefixes idempotently.
Callers import these from ``storage.fs``, which re-exports them.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from typing import Any, Mapping

from storage.filesystems import _LOCAL, invalidate_cache, is_s3, resolve

__all__ = [
    "TMP_MARKER",
    "commit_local",
    "create_only",
    "fsync_dir",
    "is_temp_name",
    "local_temp_path",
    "remove",
    "write_bytes_atomic",
    "write_text_atomic",
]

#: Temp files written by this module are named ``.<final name>.tmp-<hex>``.
TMP_MARKER = ".tmp-"


def is_temp_name(name: str) -> bool:
    """True for names of temp files written by :func:`write_bytes_atomic` and friends."""
    base = name.rsplit("/", 1)[-1]
    return base.startswith(".") and TMP_MARKER in base


# --------------------------------------------------------------------------- writes
def fsync_dir(path: str) -> None:
    """Make renames and deletions in a local directory durable (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def local_temp_path(path: str) -> str:
    """A fresh temp name next to ``path`` (same directory, so ``os.replace`` is atomic)."""
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}{TMP_MARKER}{uuid.uuid4().hex[:12]}")


def commit_local(tmp: str, path: str, durable: bool = True) -> None:
    """``os.replace`` a finished temp file onto ``path`` and make the rename durable."""
    os.replace(tmp, path)
    if durable:
        fsync_dir(os.path.dirname(path))


def _write_temp(tmp: str, data: bytes | bytearray | memoryview, fsync: bool) -> None:
    """Write ``data`` to the private temp file ``tmp`` (fsynced unless ``fsync`` is off)."""
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def write_bytes_atomic(
    uri: str | os.PathLike[str],
    data: bytes | bytearray | memoryview,
    storage_options: Mapping[str, Any] | None = None,
    *,
    fsync: bool = True,
) -> None:
    """Write ``data`` to ``uri`` so that readers see the old content or all of the new.

    Parent directories are created. Local: temp file + fsync + ``os.replace`` + directory
    fsync; a failed write leaves no temp file behind. S3: one PUT. ``fsync=False`` skips the
    two fsyncs: still atomic for other processes and across a killed process (the page cache
    survives it), not durable across a power loss or kernel crash.
    """
    fs, path = resolve(uri, storage_options)
    if fs is _LOCAL:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = local_temp_path(path)
        try:
            _write_temp(tmp, data, fsync)
            commit_local(tmp, path, durable=fsync)
        except BaseException:
            _unlink_quiet(tmp)
            raise
        return
    fs.pipe_file(path, bytes(data) if not isinstance(data, bytes) else data)
    invalidate_cache(fs, path)


def write_text_atomic(
    uri: str | os.PathLike[str],
    text: str,
    storage_options: Mapping[str, Any] | None = None,
    encoding: str = "utf-8",
    *,
    fsync: bool = True,
) -> None:
    """:func:`write_bytes_atomic` for text."""
    write_bytes_atomic(uri, text.encode(encoding), storage_options, fsync=fsync)


def _precondition_failed(exc: BaseException) -> bool:
    """Whether an S3 error is HTTP 412 (``If-None-Match: *`` found an object there).

    s3fs maps it to ``FileExistsError`` when the server names the condition (moto) and to a
    plain ``OSError(EINVAL)`` otherwise (SeaweedFS); the botocore error is its cause.
    """
    if isinstance(exc, FileExistsError):
        return True
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        response = getattr(exc, "response", None)
        if isinstance(response, Mapping):
            code = str((response.get("Error") or {}).get("Code", ""))
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def create_only(
    uri: str | os.PathLike[str],
    data: bytes | bytearray | memoryview,
    storage_options: Mapping[str, Any] | None = None,
    *,
    fsync: bool = True,
    equal_is_mine: bool = True,
) -> bool:
    """Create ``uri`` holding ``data`` unless something exists there: ``True`` if this call did.

    Of concurrent callers for one path exactly one gets ``True``; the others ``False``, and the
    file keeps the winner's bytes, complete (never a mix, never half of it).

    - local: temp file (fsynced unless ``fsync=False``) + ``os.link`` onto ``uri``, which fails
      when ``uri`` exists; then directory fsync. Filesystems without hard links fall back to
      ``O_CREAT | O_EXCL`` (still exclusive, but a reader may see the file half written).
    - S3: one PUT with ``If-None-Match: *`` (s3fs ``mode="create"``), answered 412 when the key
      exists (AWS S3; verified on moto 5.2 and SeaweedFS 4.48; servers that ignore the header
      overwrite).
    - other fsspec filesystems: an existence check, then a write (best effort, not atomic).

    A retried request whose first attempt landed sees 412: when the file already holds exactly
    ``data`` it counts as created by this call (``equal_is_mine``), so give every caller
    distinct bytes (a token); pass ``equal_is_mine=False`` where two callers may write the same
    bytes (then such a retry reads as lost).
    """
    payload = bytes(data)
    fs, path = resolve(uri, storage_options)
    if fs is _LOCAL:
        return _create_only_local(path, payload, fsync)
    try:
        if is_s3(uri):
            fs.pipe_file(path, payload, mode="create")
        else:
            if fs.exists(path):
                raise FileExistsError(path)
            fs.pipe_file(path, payload)
    except OSError as exc:
        if not _precondition_failed(exc):
            raise
        if not equal_is_mine:
            return False
        invalidate_cache(fs, path)
        try:
            return bool(fs.cat_file(path) == payload)
        except FileNotFoundError:
            return False  # created and deleted meanwhile by others: still not ours
    finally:
        invalidate_cache(fs, path)
    return True


def _create_only_local(path: str, payload: bytes, fsync: bool) -> bool:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = local_temp_path(path)
    try:
        _write_temp(tmp, payload, fsync)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            return _create_only_excl(path, payload, fsync)  # no hard links here
    finally:
        _unlink_quiet(tmp)
    if fsync:
        fsync_dir(directory)
    return True


def _create_only_excl(path: str, payload: bytes, fsync: bool) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    except BaseException:
        _unlink_quiet(path)
        raise
    if fsync:
        fsync_dir(os.path.dirname(path))
    return True


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove(
    uri: str | os.PathLike[str],
    recursive: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    *,
    missing_ok: bool = True,
) -> None:
    """Delete a file, or a directory/prefix with ``recursive=True``. Idempotent by default."""
    fs, path = resolve(uri, storage_options)
    invalidate_cache(fs, path)
    if fs is _LOCAL:
        if os.path.isdir(path) and not os.path.islink(path):
            if not recursive:
                raise IsADirectoryError(f"{uri} is a directory; pass recursive=True")
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
        elif not missing_ok:
            raise FileNotFoundError(f"nothing to remove at {uri}")
        return
    if not fs.exists(path):
        if not missing_ok:
            raise FileNotFoundError(f"nothing to remove at {uri}")
        return
    if fs.isdir(path) and not recursive:
        raise IsADirectoryError(f"{uri} is a directory (prefix); pass recursive=True")
    fs.rm(path, recursive=recursive)
    invalidate_cache(fs, path)

