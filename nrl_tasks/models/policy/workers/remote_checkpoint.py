"""Checkpoint dirs on object storage (``s3://``), handled inside the policy workers.

Policy checkpoints are written and read as local directories
(:mod:`~nrl_tasks.models.policy.workers.checkpointing`). When a path is an ``s3://`` URI the
worker itself moves the bytes, so no filesystem has to be shared with the driver:

- save (:func:`staged_uploads`, rank 0): the directories are written into a temp dir on the
  worker's node (``tempfile``, prefix ``nrl-ckpt-``), uploaded with
  :func:`storage.fs.upload_dir`, then objects under the URI that the new checkpoint does not
  contain are removed; the temp dir is always deleted. An S3 "directory" is not committed
  atomically: a caller that needs a commit writes its marker object last (the ``checkpoint``
  stage writes ``checkpoint.json``).
- load (:func:`local_copies`, every rank): each URI is downloaded into a temp dir on the
  worker's node (prefix ``nrl-ckpt-dl-``), loaded, and the temp dir deleted.

``storage_options`` (s3fs keyword arguments, credentials included) come as call arguments;
they are never logged nor put in exception messages (errors name the URI only).
``None``: the worker's own AWS environment (:func:`storage.fs.s3_options`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any, Iterator, Mapping, Optional, Sequence

from storage import fs

__all__ = ["is_remote", "local_copies", "staged_uploads"]

STAGING_PREFIX = "nrl-ckpt-"
DOWNLOAD_PREFIX = "nrl-ckpt-dl-"


def is_remote(path: Optional[str]) -> bool:
    """True for an ``s3://`` (or ``s3a://``) checkpoint path."""
    return bool(path) and str(path).startswith(("s3://", "s3a://"))


def _fs():
    return fs


@contextlib.contextmanager
def staged_uploads(
    paths: Sequence[Optional[str]], storage_options: Mapping[str, Any] | None = None
) -> Iterator[list[Optional[str]]]:
    """Local stand-ins for ``paths``: remote URIs map to dirs in one node-local temp dir (the
    same URI to the same dir), local paths and ``None`` pass through. On a clean exit every
    staged dir is uploaded to its URI (and stale objects below the URI are removed)."""
    remote = list(dict.fromkeys(p for p in paths if is_remote(p)))
    if not remote:
        yield list(paths)
        return
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX)
    local = {uri: os.path.join(staging, f"dir{i}") for i, uri in enumerate(remote)}
    try:
        yield [local.get(p, p) if p else p for p in paths]
        fs = _fs()
        for uri, src in local.items():
            if not os.path.isdir(src):
                continue  # nothing was written for it
            sent = set(fs.upload_dir(src, uri, storage_options=storage_options))
            for rel in fs.walk_files(uri, storage_options):
                if rel not in sent:  # left by an older checkpoint at the same URI
                    fs.remove(fs.join(uri, rel), storage_options=storage_options)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def local_copies(
    named_paths: Sequence[tuple[str, Optional[str]]], storage_options: Mapping[str, Any] | None = None
) -> Iterator[list[Optional[str]]]:
    """Local dirs for ``[(label, path)]``: remote URIs are downloaded into a node-local temp dir
    (deleted on exit), local paths and ``None`` pass through. ``ValueError`` naming the label and
    URI when nothing is stored there."""
    if not any(is_remote(p) for _, p in named_paths):
        yield [p for _, p in named_paths]
        return
    fs = _fs()
    tmp = tempfile.mkdtemp(prefix=DOWNLOAD_PREFIX)
    try:
        out: list[Optional[str]] = []
        for i, (label, path) in enumerate(named_paths):
            if not is_remote(path):
                out.append(path)
                continue
            dst = os.path.join(tmp, f"dir{i}")
            try:
                fs.download_dir(path, dst, storage_options=storage_options)
            except FileNotFoundError:
                raise ValueError(f"{label} {path!r} holds no checkpoint files") from None
            out.append(dst)
        yield out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
