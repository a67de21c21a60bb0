"""The file manifest of a checkpoint: what ``checkpoint.json`` lists at save, what a restore checks.

At save, ``checkpoint.json`` (written last: the commit) lists every file of ``weights/`` and
``optimizer/`` with its size and content checksum::

    "files": {"weights/model.safetensors": {"size": 510312, "checksum": "9f0c..."}, ...},
    "checksum_algorithm": "xxh3-128",
    "optimizer": true,              # optimizer/ was written: a restore needs it
    "weights_checksum": "25c0...",  # the policy's weights checksum after the step's train

Before a restore every listed file must exist with its size and checksum
(:func:`check_checkpoint`); after loading, the policy's weights checksum must equal the one
recorded for that step (checked by the resume executor, :mod:`flows.run.recovery`). A local
checkpoint is hashed in this process; an ``s3://`` one is checked by size only (its bytes are
read by the policy workers on their own nodes, never by this process), and its manifest
records no checksums. A checkpoint written before file manifests (no ``files``) can only be
checked after loading, by the weights checksum.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from nrl_tasks.run_layout import join_uri
from nrl_tasks.stages.errors import DamagedRunError
from storage import fs
from storage.checksum import default_algorithm, new_hasher

__all__ = [
    "CheckpointDamagedError",
    "check_checkpoint",
    "file_manifest",
    "read_checkpoint_json",
    "remote_file_manifest",
]

COMMIT_FILE = "checkpoint.json"
#: the directories of a checkpoint whose files the manifest lists
CONTENT_DIRS = ("weights", "optimizer")
_CHUNK = 16 << 20


class CheckpointDamagedError(DamagedRunError):
    """A checkpoint's files (or the weights loaded from them) are not what it recorded."""

    def __init__(self, step: int, uri: str, problem: str) -> None:
        super().__init__(f"checkpoint {uri} (step {step}) is damaged: {problem}")
        self.step, self.uri, self.problem = step, uri, problem


def _fs():
    return fs


def _is_s3(uri: str) -> bool:
    return uri.startswith("s3://") or uri.startswith("s3a://")


def _local(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


def read_checkpoint_json(uri: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``checkpoint.json`` of the checkpoint at ``uri``; ``DamagedRunError`` naming the file when
    it is not a JSON object."""
    path = join_uri(uri, COMMIT_FILE)
    text = _fs().read_text(path, storage_options=storage_options)
    try:
        info = json.loads(text)
    except ValueError as exc:
        raise DamagedRunError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(info, dict):
        raise DamagedRunError(f"{path} holds a JSON {type(info).__name__}, not an object")
    return info


def _file_checksum(path: str, algorithm: str) -> str:
    hasher = new_hasher(algorithm)
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def file_manifest(local_dir: str, algorithm: str | None = None) -> dict[str, Any]:
    """The ``files`` / ``checksum_algorithm`` entries of ``checkpoint.json`` for the checkpoint
    written in ``local_dir`` (every file under ``weights/`` and ``optimizer/``)."""

    algorithm = algorithm or default_algorithm()
    files: dict[str, dict[str, Any]] = {}
    for sub in CONTENT_DIRS:
        top = os.path.join(local_dir, sub)
        for root, _dirs, names in os.walk(top):
            for name in names:
                path = os.path.join(root, name)
                rel = os.path.relpath(path, local_dir).replace(os.sep, "/")
                files[rel] = {"size": os.path.getsize(path), "checksum": _file_checksum(path, algorithm)}
    return {"files": dict(sorted(files.items())), "checksum_algorithm": algorithm}


def _remote_sizes(uri: str, storage_options: dict[str, Any] | None) -> dict[str, int]:
    fs, path = _fs().resolve(uri, storage_options)
    _fs().invalidate_cache(fs, path)
    prefix = path.rstrip("/") + "/"
    out = {}
    for sub in CONTENT_DIRS:
        try:
            found = fs.find(prefix + sub, detail=True)
        except FileNotFoundError:
            continue
        for p, entry in found.items():
            if p.startswith(prefix):
                out[p[len(prefix) :]] = int(entry.get("size") or 0)
    return out


def remote_file_manifest(uri: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``files`` entry of an ``s3://`` checkpoint's ``checkpoint.json``: sizes only."""
    return {"files": {rel: {"size": size} for rel, size in sorted(_remote_sizes(uri, storage_options).items())}}


def check_checkpoint(
    uri: str, storage_options: dict[str, Any] | None = None, *, info: Mapping[str, Any] | None = None
) -> str | None:
    """What is wrong with the files of the committed checkpoint at ``uri`` (``None``: nothing
    found): ``checkpoint.json`` unreadable, or a listed file missing, of another size or
    checksum. Every problem names the file. A checkpoint without a file manifest passes (only
    its weights checksum after loading can tell)."""
    try:
        info = dict(info) if info is not None else read_checkpoint_json(uri, storage_options)
    except DamagedRunError as exc:
        return str(exc)
    listed = info.get("files")
    if not isinstance(listed, dict):
        return None
    if info.get("optimizer") and not any(rel.startswith("optimizer/") for rel in listed):
        return f"{join_uri(uri, COMMIT_FILE)} records an optimizer state but lists no optimizer/ file"
    if _is_s3(uri):
        have = _remote_sizes(uri, storage_options)
        return _compare(uri, listed, lambda rel: have.get(rel), None)
    base = os.path.abspath(_local(uri))
    algorithm = str(info.get("checksum_algorithm") or "")

    def size_of(rel: str) -> int | None:
        path = os.path.join(base, *rel.split("/"))
        return os.path.getsize(path) if os.path.isfile(path) else None

    return _compare(uri, listed, size_of, lambda rel: _file_checksum(os.path.join(base, *rel.split("/")), algorithm))


def _compare(uri: str, listed: Mapping[str, Any], size_of: Any, checksum_of: Any) -> str | None:
    missing = [rel for rel in listed if size_of(rel) is None]
    if missing:
        more = f"; {len(missing) - 1} more of its {len(listed)} files are missing too" if len(missing) > 1 else ""
        return f"{join_uri(uri, missing[0])} is missing ({COMMIT_FILE} lists it{more})"
    for rel, want in listed.items():
        size = size_of(rel)
        if size != int(want.get("size", -1)):
            return f"{join_uri(uri, rel)} has {size} bytes, {COMMIT_FILE} lists {want.get('size')}"
    if checksum_of is None:
        return None
    for rel, want in listed.items():
        if want.get("checksum") is None:
            continue
        got = checksum_of(rel)
        if got != want["checksum"]:
            return f"{join_uri(uri, rel)} has checksum {got}, {COMMIT_FILE} lists {want['checksum']}"
    return None
