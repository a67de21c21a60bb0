"""Save and load ``BatchedDataDict``s as committed Arrow IPC datasets.

A dataset at ``uri`` (local path, ``file://`` or ``s3://``) is a directory of shard files
``part-00000.arrow`` ... (contiguous row ranges, in order) plus ``_manifest.json``, written
last: the manifest is the commit. Readers need the manifest and check every shard against it.

This module holds the read side (``load_batch``, ``read_manifest``, ``is_committed``,
``list_batches``) and ``delete_batch``. The write side, ``save_batch`` with its exclusive
commit protocol and durability guarantees, is ``storage.commit`` (re-exported here, with
``shard_ranges``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal, Mapping, Optional, Sequence, Union

import numpy as np
import pyarrow as pa

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from storage import fs as sfs
from storage.codec import decode_column
from storage.commit import save_batch, shard_ranges
from storage.errors import CorruptDatasetError, MissingShardError, NotCommittedError
from storage.manifest import MANIFEST_NAME, SHARD_RE, Manifest, parse_manifest
from storage.shard_io import VerifyMode, check_shard, open_local_shard, read_table
from storage.tensor_codec import BufferBase, concat_rows

__all__ = [
    "delete_batch",
    "is_committed",
    "list_batches",
    "load_batch",
    "read_manifest",
    "save_batch",
    "shard_ranges",
]

Verify = Union[bool, Literal["full", "size", "none"]]


def _remove_stale(fs: Any, path: str, keep: Sequence[str] = ()) -> None:
    """Delete shard and temp files of earlier attempts in a dataset directory."""
    sfs.invalidate_cache(fs, path)
    try:
        entries = fs.ls(path, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return
    stale = []
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name in keep:
            continue
        if SHARD_RE.match(name) or (sfs.is_temp_name(name) and name.startswith((".part-", "._manifest"))):
            stale.append(entry)
    if stale:
        fs.rm(stale)
        sfs.invalidate_cache(fs, path)


# --------------------------------------------------------------------------- manifests
def _check_columns(schema: pa.Schema, specs: Sequence[Any], where: str) -> None:
    """Each manifest column spec must agree with the tags the writer put on the shard's field.

    The shard's bytes are covered by its checksum, the manifest's column specs are not: without
    this a damaged spec (another dtype or shape of the same width, another kind) would decode
    different values. ``storage`` is checked against the Arrow type while decoding; ``arrow_type``
    is informational.
    """
    for spec in specs:
        meta = schema.field(spec.name).metadata or {}
        found = (meta.get(b"nrl.kind"), meta.get(b"nrl.dtype"), meta.get(b"nrl.shape"))
        promised = (
            spec.kind.encode(),
            None if spec.dtype is None else spec.dtype.encode(),
            None if spec.shape is None else json.dumps(spec.shape).encode(),
        )
        if found != promised:
            raise CorruptDatasetError(
                f"shard {where} column {spec.name!r} is tagged (kind, dtype, shape) {found}, manifest says {promised}"
            )


def read_manifest(
    uri: str | os.PathLike[str], storage_options: Optional[Mapping[str, Any]] = None
) -> Manifest:
    """The manifest of a committed dataset (its ``uri`` set to the ``uri`` given here).

    Raises ``NotCommittedError`` (a ``FileNotFoundError``) naming ``uri`` when there is none.
    """
    uri = os.fspath(uri)
    target = sfs.join(uri, MANIFEST_NAME)
    try:
        raw = sfs.read_bytes(target, storage_options)
    except (FileNotFoundError, NotADirectoryError):
        raise NotCommittedError(f"{uri} is not committed: no {MANIFEST_NAME}") from None
    return parse_manifest(raw, target, uri)


def is_committed(
    uri: str | os.PathLike[str], storage_options: Optional[Mapping[str, Any]] = None
) -> bool:
    """Whether ``uri`` holds a manifest (the shards are checked by ``load_batch``)."""
    return sfs.exists(sfs.join(os.fspath(uri), MANIFEST_NAME), storage_options)


def list_batches(
    prefix: str | os.PathLike[str], storage_options: Optional[Mapping[str, Any]] = None
) -> list[Manifest]:
    """Manifests of every committed dataset at or below ``prefix``, sorted by URI.

    Each manifest's ``uri`` is ``prefix`` joined with the dataset's relative path.
    Uncommitted directories (no manifest) are not listed.
    """
    prefix = os.fspath(prefix)
    found = []
    for rel in sfs.walk_files(prefix, storage_options):
        parts = rel.split("/")
        if parts[-1] == MANIFEST_NAME:
            found.append("/".join(parts[:-1]))
    fs, path = sfs.resolve(prefix, storage_options)
    uris = sorted({sfs.join(prefix, rel) for rel in found})
    if not uris:
        return []
    rels = {u: u[len(prefix.rstrip("/")) :].strip("/") for u in uris}
    paths = {u: "/".join(p for p in (path, rels[u], MANIFEST_NAME) if p) for u in uris}
    raws = fs.cat(list(paths.values()), on_error="return")
    out = []
    for u in uris:
        raw = raws.get(paths[u])
        if isinstance(raw, (FileNotFoundError, NotADirectoryError)):
            continue  # deleted meanwhile
        if isinstance(raw, BaseException):
            raise raw
        out.append(parse_manifest(raw, paths[u], u))
    return out


def delete_batch(
    uri: str | os.PathLike[str], storage_options: Optional[Mapping[str, Any]] = None
) -> None:
    """Uncommit (manifest first) and delete a dataset's files; idempotent.

    Only the manifest, shard files and temp files of this store are removed; the directory
    goes too when that leaves it empty (local).
    """
    uri = os.fspath(uri)
    fs, path = sfs.resolve(uri, storage_options)
    sfs.invalidate_cache(fs, path)
    manifest_path = f"{path}/{MANIFEST_NAME}"
    if fs.exists(manifest_path):
        fs.rm(manifest_path)
    _remove_stale(fs, path)
    if sfs.is_local(uri):
        try:
            os.rmdir(path)
        except OSError:
            pass  # missing or not empty


# --------------------------------------------------------------------------- load
def _verify_mode(verify: Verify) -> VerifyMode:
    if verify is True or verify == "full":
        return "full"
    if verify is False or verify == "none":
        return "none"
    if verify == "size":
        return "size"
    raise ValueError(f"verify must be True, False, 'full', 'size' or 'none', got {verify!r}")


def _fetch_remote(fs: Any, paths: list[str]) -> list[np.ndarray]:
    raws = fs.cat(paths, on_error="return")
    out = []
    for p in paths:
        raw = raws.get(p)
        if raw is None or isinstance(raw, FileNotFoundError):
            raise MissingShardError(f"shard {p} is missing (named by the manifest)")
        if isinstance(raw, BaseException):
            raise raw
        writable = np.empty(len(raw), dtype=np.uint8)  # tensors get writable memory
        writable[:] = np.frombuffer(raw, dtype=np.uint8)
        out.append(writable)
    return out


def load_batch(
    uri: str | os.PathLike[str],
    shard: Optional[int] = None,
    *,
    storage_options: Optional[Mapping[str, Any]] = None,
    verify: Verify = True,
    mmap: bool = True,
    copy: bool = False,
    columns: Optional[Sequence[str]] = None,
) -> Any:
    """Load a committed dataset as a ``BatchedDataDict``: all rows in order, or shard ``shard``.

    ``verify``: ``True``/``"full"`` (default) checks every shard's size and checksum
    (xxh3 runs at ~5 GB/s, so this stays near memory speed); ``"size"`` checks existence and
    sizes only; ``False``/``"none"`` trusts the manifest. A missing manifest raises
    ``NotCommittedError``; a missing shard ``MissingShardError``; a wrong size, checksum,
    row count or schema ``CorruptDatasetError``; each names the file. The manifest's column
    specs are checked against each shard's own field tags, and anything that fails to decode
    is a ``CorruptDatasetError`` too. Guarantee (fuzzed in ``tests/faults/test_store_fuzz.py``):
    with full verification a damaged dataset never loads different data; without it, flipped
    data bytes can come through (Arrow's full validation still runs, so offsets and lengths
    cannot crash the process), but nothing else than these errors is raised.

    Memory: local shards are memory-mapped copy-on-write (``mmap=True``), and tensors are
    zero-copy views of the mapping (one shard; several shards are concatenated, one copy).
    Such tensors are writable; in-place writes stay private to this process and never reach
    the file. ``mmap=False`` reads files into memory; remote (S3) shards are always read
    into memory. ``copy=True`` clones tensors so nothing refers to the mapping. Tensors come
    back on CPU. ``columns`` loads a subset of columns, in the given order.
    """

    uri = os.fspath(uri)
    mode = _verify_mode(verify)
    manifest = read_manifest(uri, storage_options)
    if shard is None:
        infos = list(manifest.shards)
    else:
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < manifest.num_shards:
            raise ValueError(f"shard must be an int in [0, {manifest.num_shards}) for {uri}, got {shard!r}")
        infos = [manifest.shards[shard]]
    specs = list(manifest.columns)
    if columns is not None:
        by_name = {c.name: c for c in specs}
        missing = [c for c in columns if c not in by_name]
        if missing:
            raise ValueError(f"columns {missing} are not in {uri}; it has {list(by_name)}")
        specs = [by_name[c] for c in columns]

    fs, path = sfs.resolve(uri, storage_options)
    paths = [f"{path}/{info.name}" for info in infos]
    if sfs.is_local(uri):
        blobs = [
            open_local_shard(p, info, mode, manifest.checksum_algorithm, mmap)
            for p, info in zip(paths, infos)
        ]
    else:
        blobs = _fetch_remote(fs, paths)
        for blob, p, info in zip(blobs, paths, infos):
            check_shard(blob, info, p, mode, manifest.checksum_algorithm)

    parts: dict[str, list[Any]] = {spec.name: [] for spec in specs}
    checked: Optional[pa.Schema] = None  # shards of one dataset share one schema: check it once
    for blob, p, info in zip(blobs, paths, infos):
        table = read_table(blob, p, info.rows)
        if checked is None or not table.schema.equals(checked, check_metadata=True):
            names = table.schema.names
            if names != manifest.column_names:
                raise CorruptDatasetError(f"shard {p} has columns {names}, manifest says {manifest.column_names}")
            _check_columns(table.schema, specs, p)
            checked = table.schema
        if mode != "full":  # unhashed bytes: let Arrow check offsets and lengths before decoding
            try:
                table.validate(full=True)
            except pa.ArrowException as exc:
                raise CorruptDatasetError(f"shard {p} is damaged: {exc}") from None
        base = BufferBase.of(blob)
        for spec in specs:
            chunks = table.column(spec.name).chunks
            try:
                parts[spec.name].append(decode_column(spec, chunks, base))
            except (ValueError, TypeError, RuntimeError, LookupError, AttributeError, OverflowError, pa.ArrowException) as exc:
                if isinstance(exc, CorruptDatasetError):
                    raise
                raise CorruptDatasetError(f"shard {p} column {spec.name!r} cannot be decoded: {exc}") from None

    out: dict[str, Any] = {}
    for spec in specs:
        pieces = parts[spec.name]
        if spec.kind == "tensor":
            value = concat_rows(pieces)
            out[spec.name] = value.clone() if copy and len(pieces) == 1 else value
        else:
            merged = [item for piece in pieces for item in piece]
            if copy and spec.kind == "tensor_list":
                merged = [None if t is None else t.clone() for t in merged]
            out[spec.name] = merged
    return BatchedDataDict(out)
