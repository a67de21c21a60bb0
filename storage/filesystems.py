"""How a URI maps to an fsspec filesystem: local paths, ``file://``, ``s3://`` and other schemes.

URI helpers (``is_s3``, ``is_local``, ``join``), S3 configuration (``s3_options``,
``mask_options``), :func:`resolve` and the retrying wrapper for remote filesystems. Callers
import these from ``storage.fs``, which re-exports them.

S3 configuration comes from explicit ``storage_options`` (s3fs keyword arguments, e.g.
``{"endpoint_url": ..., "key": ..., "secret": ...}``) or else from the standard AWS variables:
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN`` (and whatever else botocore's default chain finds, e.g. a profile).
No region is forced (s3fs with ``region_name="us-east-1"`` breaks bucket creation).
Credentials never appear in errors or reprs: use :func:`mask_options` to show options.

Remote filesystems returned by :func:`resolve` retry transient failures (endpoint down,
connection reset, throttling, HTTP 5xx) with exponential backoff per ``storage.retry``; after
the last attempt a ``StorageUnavailableError`` (an ``OSError``) names the operation and path.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import fsspec
from fsspec.implementations.local import LocalFileSystem

from storage.retry import call_with_retry, is_transient

__all__ = [
    "RetryingFileSystem",
    "invalidate_cache",
    "is_local",
    "is_s3",
    "join",
    "mask_options",
    "resolve",
    "s3_options",
]

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

