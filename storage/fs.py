"""Filesystem helpers shared by every nrl-flows writer: local paths, ``file://`` and ``s3://``.

One place decides how a URI maps to an fsspec filesystem, how S3 is configured and how a file
is written so that a reader never sees half of it:

- local: a temp file in the same directory (``.<name>.tmp-<random>``), ``fsync``, ``os.replace``,
  then ``fsync`` of the directory;
- S3: a single PUT (or a multipart upload completed at the end); S3 makes an object visible
  only once it is complete, so the object itself is the commit.

S3 configuration comes from explicit ``storage_options`` (s3fs keyword arguments, e.g.
``{"endpoint_url": ..., "key": ..., "secret": ...}``) or else from the standard AWS variables:
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN`` (and whatever else botocore's default chain finds, e.g. a profile).
No region is forced (s3fs with ``region_name="us-east-1"`` breaks bucket creation).
Credentials never appear in errors or reprs: use :func:`mask_options` to show options.

Remote filesystems returned by :func:`resolve` retry transient failures (endpoint down,
connection reset, throttling, HTTP 5xx) with exponential backoff per ``storage.retry``; after
the last attempt a ``StorageUnavailableError`` (an ``OSError``) names the operation and path.

s3fs caches directory listings per filesystem instance; every query here that depends on
what exists (``exists``, ``list_dir``, ``walk_files``) drops the cache for its path first, so
writes by other processes are seen.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import uuid
from typing import Any, Mapping

import fsspec
from fsspec.implementations.local import LocalFileSystem

from storage.retry import call_with_retry, is_transient

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

#: Temp files written by this module are named ``.<final name>.tmp-<hex>``.
TMP_MARKER = ".tmp-"
_SECRET_WORDS = ("secret", "token", "password", "key", "credential", "session")
_LOCAL = LocalFileSystem()


# --------------------------------------------------------------------------- URIs
def is_s3(uri: str | os.PathLike[str]) -> bool:
    """True for ``s3://`` (and ``s3a://``) URIs."""
    return str(uri).startswith(("s3://", "s3a://"))


def is_local(uri: str | os.PathLike[str]) -> bool:
    """True for plain paths and ``file://`` URIs."""
    text = str(uri)
    return text.startswith("file://") or "://" not in text


def _local_path(uri: str) -> str:
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    return os.path.abspath(os.path.expanduser(uri))


def join(uri: str | os.PathLike[str], *parts: str) -> str:
    """Join path parts onto a URI with ``/``, keeping its scheme.

    >>> join("s3://bucket/run", "steps", "step_000001/")
    's3://bucket/run/steps/step_000001'
    >>> join("/tmp/run/", "a")
    '/tmp/run/a'
    """
    out = str(uri)
    for part in parts:
        part = str(part).strip("/")
        if part:
            out = out.rstrip("/") + "/" + part
    return out


def is_temp_name(name: str) -> bool:
    """True for names of temp files written by :func:`write_bytes_atomic` and friends."""
    base = name.rsplit("/", 1)[-1]
    return base.startswith(".") and TMP_MARKER in base


# --------------------------------------------------------------------------- filesystems
def mask_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``options`` safe to print: credential values replaced by ``'***'``.

    >>> mask_options({"key": "AKIA", "secret": "s", "endpoint_url": "http://127.0.0.1:9000"})
    {'key': '***', 'secret': '***', 'endpoint_url': 'http://127.0.0.1:9000'}
    """
    out: dict[str, Any] = {}
    for name, value in (options or {}).items():
        lowered = str(name).lower()
        if isinstance(value, Mapping):
            out[name] = mask_options(value)
        elif any(word in lowered for word in _SECRET_WORDS) and value is not None:
            out[name] = "***"
        else:
            out[name] = value
    return out


def s3_options(storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """s3fs keyword arguments: explicit options win, the AWS environment fills the gaps.

    Explicit ``storage_options`` are used as given when they name an endpoint or credentials;
    otherwise ``endpoint_url`` comes from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` and
    ``key``/``secret``/``token`` from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
    ``AWS_SESSION_TOKEN`` (passing them explicitly makes fsspec's instance cache follow
    changes of the environment).
    """
    opts = dict(storage_options or {})
    client_kwargs = opts.get("client_kwargs") or {}
    if "endpoint_url" not in opts and "endpoint_url" not in client_kwargs:
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["endpoint_url"] = endpoint
    explicit_creds = any(k in opts for k in ("key", "secret", "token", "anon", "profile"))
    if not explicit_creds:
        for opt, env in (
            ("key", "AWS_ACCESS_KEY_ID"),
            ("secret", "AWS_SECRET_ACCESS_KEY"),
            ("token", "AWS_SESSION_TOKEN"),
        ):
            if os.environ.get(env):
                opts[opt] = os.environ[env]
    return opts


def _one_botocore_attempt(opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` with botocore's own retries off unless configured: ``storage.retry`` decides."""
    config_kwargs = dict(opts.get("config_kwargs") or {})
    if "retries" not in config_kwargs:
        config_kwargs["retries"] = {"max_attempts": 1, "mode": "standard"}
        opts = {**opts, "config_kwargs": config_kwargs}
    return opts


#: Methods of a remote filesystem that are retried on transient errors (all idempotent).
_RETRIED = frozenset(
    {
        "cat", "cat_file", "cat_ranges", "du", "exists", "find", "get", "get_file", "glob", "head",
        "info", "isdir", "isfile", "ls", "makedirs", "mkdir", "pipe", "pipe_file", "put", "put_file",
        "size", "sizes", "tail", "touch", "call_s3",
    }
)
_DELETES = frozenset({"rm", "rm_file", "rmdir"})


class RetryingFileSystem:
    """A remote fsspec filesystem whose idempotent calls retry transient errors (``storage.retry``).

    Attribute access is delegated; the calls in ``_RETRIED`` and the deletes go through
    :func:`storage.retry.call_with_retry` (a delete that finds nothing on a retry succeeded
    earlier). ``cat(..., on_error="return")`` results holding a transient error count as a
    failed call.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self._fs = fs

    @property
    def wrapped(self) -> fsspec.AbstractFileSystem:
        return self._fs

    def __repr__(self) -> str:
        return f"RetryingFileSystem({type(self._fs).__name__})"  # never the options (credentials)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if name not in _RETRIED and name not in _DELETES:
            return attr
        proto = getattr(self._fs, "protocol", "remote")
        proto = proto[0] if isinstance(proto, (tuple, list)) else proto

        def call(*args: Any, **kwargs: Any) -> Any:
            target = args[0] if args else kwargs.get("path", "")
            if isinstance(target, Mapping):
                target = list(target)
            if isinstance(target, (list, tuple)):
                target = f"{target[0]} (+{len(target) - 1} more)" if len(target) > 1 else (target or [""])[0]

            def once() -> Any:
                out = attr(*args, **kwargs)
                if isinstance(out, dict):
                    for value in out.values():
                        if isinstance(value, BaseException) and is_transient(value):
                            raise value
                return out

            return call_with_retry(
                once, what=f"{name} {proto}://{target}", on_retry_missing_ok=name in _DELETES
            )

        return call


def resolve(
    uri: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """``(filesystem, path)`` for a URI: local absolute path, ``bucket/key`` for S3.

    >>> fs, path = resolve("file:///tmp/x/")
    >>> type(fs).__name__, path
    ('LocalFileSystem', '/tmp/x')
    """
    text = os.fspath(uri)
    if not isinstance(text, str) or not text:
        raise ValueError(f"expected a non-empty path or URI, got {uri!r}")
    if is_local(text):
        return _LOCAL, _local_path(text).rstrip("/") or "/"
    if is_s3(text):
        fs = fsspec.filesystem("s3", **_one_botocore_attempt(s3_options(storage_options)))
        return RetryingFileSystem(fs), text.split("://", 1)[1].rstrip("/")  # type: ignore[return-value]
    fs, path = fsspec.core.url_to_fs(text, **dict(storage_options or {}))
    return RetryingFileSystem(fs), path.rstrip("/")  # type: ignore[return-value]


def invalidate_cache(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Drop fsspec's cached listings at and above ``path`` (remote filesystems only)."""
    if fs is not _LOCAL:
        fs.invalidate_cache(path)


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
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
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
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
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
