"""Write path of the batch store: ``save_batch`` and its exclusive commit.

A dataset is a directory of shard files plus ``_manifest.json``, written last: the manifest is
the commit (layout and read path: ``storage.store``; manifest schema: ``storage.manifest``).

Write protocol (``save_batch``): validate and encode the whole batch first (bad input raises
before anything is touched); if the URI is committed, refuse unless ``overwrite=True``, and
then delete the old manifest first (uncommit), so a crash anywhere later leaves nothing that
loads, then the shards it named; write each shard create-only (local: temp file + fsync +
``os.link``; S3: a PUT with ``If-None-Match: *``) under its plain name ``part-00000.arrow``,
or, when that name is taken (a crashed attempt or a concurrent writer left a file there),
under this attempt's own name ``part-00000.<token>.arrow``: no writer ever overwrites a shard
file; create the manifest create-only too (``storage.fs.create_only``). Exclusive commit: of
concurrent writers of one URI exactly one creates the manifest, and it names only files that
writer created; the others raise ``AlreadyCommittedError`` and remove their own files. After
the commit, leftovers of earlier attempts (shard and temp files not in the manifest, older
than its oldest shard) are deleted. Manifests of older datasets (plain names) read as before.
Limit: ``overwrite=True`` deletes the files the replaced manifest names; if a third party
(another overwrite or ``delete_batch``) removed that manifest meanwhile and a plain writer
reused a plain name, that writer's file can go too (its dataset then fails to load, it never
loads other data). Run one writer per run (``storage.lease``) to rule this out.

Durability (local): with ``fsync=True`` (default) every shard file and the directory are
fsynced before the manifest is written, and the manifest and the directory after it, so a
committed manifest implies durable shards even across a power loss. ``fsync=False`` skips
all of these: every step stays atomic (temp + rename, manifest last), which keeps datasets
consistent across a killed process (the OS page cache survives it) but not across a power
loss or kernel crash (a manifest could then survive without its shards: such a dataset fails
to load, it is never read as valid).

Filesystem calls go through the ``storage.fs`` module object (``sfs.create_only(...)``), so
tests that patch ``storage.fs`` attributes reach this path.
"""

from __future__ import annotations

import json
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Optional, Sequence

from fsspec.implementations.local import LocalFileSystem
import pyarrow as pa

from storage import fs as sfs
from storage.checksum import combine, default_algorithm
from storage.codec import encode_columns
from storage.errors import AlreadyCommittedError, CorruptDatasetError
from storage.retry import StorageUnavailableError
from storage.manifest import MANIFEST_NAME, SHARD_RE, Manifest, ShardInfo, parse_manifest, shard_name
from storage.shard_io import serialize, write_local

__all__ = [
    "save_batch",
    "shard_ranges",
]

_S3_PUT_GROUP_BYTES = 256 << 20  # shards buffered in memory per concurrent S3 upload round


def shard_ranges(rows: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` row ranges; the first ``rows % num_shards`` get one more.

    >>> shard_ranges(5, 3)
    [(0, 2), (2, 4), (4, 5)]
    >>> shard_ranges(1, 3)
    [(0, 1), (1, 1), (1, 1)]
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    base, extra = divmod(rows, num_shards)
    out, start = [], 0
    for i in range(num_shards):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _check_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in meta.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"meta {key!r}={value!r} is not JSON-serializable: {exc}") from None
    return dict(meta)


# --------------------------------------------------------------------------- save
def _attempt_name(index: int, token: str) -> str:
    """Shard file name of one writer attempt, used when the plain name is taken."""
    return f"part-{index:05d}.{token}.arrow"


def _mtime(entry: Mapping[str, Any]) -> Optional[float]:
    """Modification time of an ``fs.ls(detail=True)`` entry (local ``mtime``, S3 ``LastModified``)."""
    value = entry.get("mtime", entry.get("LastModified"))
    if value is None:
        return None
    return float(value.timestamp()) if hasattr(value, "timestamp") else float(value)


def _clean_after_commit(fs: Any, path: str, manifest: Manifest) -> None:
    """Delete leftovers of earlier attempts once ``manifest`` is committed (best effort).

    Only shard and temp files this store names, not listed by ``manifest``, and strictly older
    than the oldest shard of ``manifest`` (by the filesystem's own clock) go: files of a writer
    that started after this commit (e.g. an overwrite) are never touched.
    """
    ours = {s.name for s in manifest.shards}
    sfs.invalidate_cache(fs, path)
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return
    by_name = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries}
    times = [_mtime(by_name[n]) for n in ours if n in by_name]
    if not times or any(t is None for t in times):
        return
    oldest = min(t for t in times if t is not None)
    stale = []
    for name, entry in by_name.items():
        if name in ours or not (SHARD_RE.match(name) or (sfs.is_temp_name(name) and name.startswith((".part-", "._manifest")))):
            continue
        when = _mtime(entry)
        if when is not None and when < oldest:
            stale.append(entry["name"])
    _rm_quiet(fs, stale)
    sfs.invalidate_cache(fs, path)


def _place_shard(fs: Any, path: str, index: int, token: str, write: Any) -> str:
    """Store one shard create-only under its plain name, else under this attempt's name.

    ``write(name) -> bool`` creates ``path/name`` exclusively. The plain name is taken when an
    earlier attempt (crashed, or another writer racing this one) left a file there: such a file
    is never overwritten, since another writer's committed manifest may refer to it.
    """
    name = shard_name(index)
    if write(name):
        return name
    name = _attempt_name(index, token)
    if not write(name):
        raise FileExistsError(f"shard {path}/{name} exists already (token collision)")
    return name


def _write_shards(
    fs: Any, path: str, local: bool, columns: Sequence[Any], schema: pa.Schema,
    ranges: Sequence[tuple[int, int]], algorithm: str, token: str, fsync: bool, written: list[str],
    uri: str, storage_options: Optional[Mapping[str, Any]],
) -> list[ShardInfo]:
    """Write every shard create-only (local: temp file + ``os.link``; S3: conditional PUTs, run
    concurrently in rounds of up to ``_S3_PUT_GROUP_BYTES`` buffered bytes)."""
    shards: list[ShardInfo] = []
    pending: list[tuple[int, int, int, bytes, str]] = []  # index, start, stop, data, checksum

    def put(index: int, data: bytes) -> str:
        # two writers of one deterministic batch write the same bytes: equal is not ours
        return _place_shard(
            fs, path, index, token,
            lambda n: sfs.create_only(sfs.join(uri, n), data, storage_options, equal_is_mine=False),
        )

    def flush() -> None:
        if len(pending) == 1:
            names = [put(pending[0][0], pending[0][3])]
        else:
            with ThreadPoolExecutor(max_workers=min(8, len(pending))) as pool:
                futures = [pool.submit(put, index, data) for index, _, _, data, _ in pending]
            # every PUT has finished: on an error, record the others' files for removal first
            failed = [f.exception() for f in futures if f.exception() is not None]
            if failed:
                written.extend(f.result() for f in futures if f.exception() is None)
                raise failed[0]
            names = [f.result() for f in futures]
        for name, (_index, start, stop, data, checksum) in zip(names, pending):
            written.append(name)
            shards.append(ShardInfo(name=name, start=start, rows=stop - start, bytes=len(data), checksum=checksum))
        pending.clear()

    buffered = 0
    for index, (start, stop) in enumerate(ranges):
        table = pa.Table.from_arrays([c.rows(start, stop) for c in columns], schema=schema)
        if not local:
            buf, checksum = serialize(schema, table, algorithm)
            pending.append((index, start, stop, buf.to_pybytes(), checksum))
            buffered += buf.size
            if buffered >= _S3_PUT_GROUP_BYTES:
                flush()
                buffered = 0
            continue
        tmp = sfs.local_temp_path(f"{path}/{shard_name(index)}")
        try:
            size, checksum = write_local(tmp, schema, table, algorithm, fsync=fsync)

            def link(name: str) -> bool:
                try:
                    os.link(tmp, f"{path}/{name}")
                except FileExistsError:
                    return False
                return True

            name = _place_shard(fs, path, index, token, link)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        written.append(name)
        shards.append(ShardInfo(name=name, start=start, rows=stop - start, bytes=size, checksum=checksum))
    if pending:
        flush()
    return shards


def save_batch(
    batch: Mapping[str, Any],
    uri: str | os.PathLike[str],
    num_shards: int = 1,
    *,
    overwrite: bool = False,
    storage_options: Optional[Mapping[str, Any]] = None,
    fsync: bool = True,
    **meta: Any,
) -> Manifest:
    """Write ``batch`` as ``num_shards`` Arrow IPC files plus ``_manifest.json`` (the commit).

    ``batch``: a ``BatchedDataDict`` (or any mapping of column -> tensor/list). Columns keep
    their order. ``meta`` (JSON values: ``run_id``, ``step``, ``stage``, ``weights_version``...)
    goes into the manifest. Raises ``AlreadyCommittedError`` (a ``FileExistsError``) if ``uri``
    is committed and ``overwrite`` is false, or when another writer commits ``uri`` while this
    call writes (the race's loser; its own files are removed); ``ValueError``/``TypeError``
    naming the column for bad input, before anything is written or deleted; an ``OSError`` of
    the same errno naming ``uri`` when the filesystem fails (disk full...), chained to the
    original. ``fsync``: local durability (module docstring); ignored for object stores.
    """
    uri = os.fspath(uri)
    shard_ranges(0, num_shards)  # validates num_shards early
    meta = _check_meta(meta)
    fs, path = sfs.resolve(uri, storage_options)
    local = sfs.is_local(uri)
    manifest_path = f"{path}/{MANIFEST_NAME}"
    sfs.invalidate_cache(fs, path)
    committed = fs.exists(manifest_path)
    if committed and not overwrite:
        raise AlreadyCommittedError(
            f"{uri} is already a committed dataset; pass overwrite=True to replace it"
        )
    rows, columns, schema = encode_columns(batch)  # bad input raises here, nothing touched yet
    ranges = shard_ranges(rows, num_shards)
    token = uuid.uuid4().hex[:12]
    written: list[str] = []
    try:
        if committed:
            _uncommit(fs, path, local and fsync)
        if local:
            os.makedirs(path, exist_ok=True)
        algorithm = default_algorithm()
        shards = _write_shards(
            fs, path, local, columns, schema, ranges, algorithm, token, fsync, written, uri, storage_options
        )
        if local and fsync:
            sfs.fsync_dir(path)
        manifest = Manifest(
            uri=uri,
            rows=rows,
            num_shards=num_shards,
            shards=shards,
            columns=[c.spec for c in columns],
            meta=meta,
            checksum_algorithm=algorithm,
            checksum=combine(s.checksum for s in shards),
        )
        won = sfs.create_only(
            sfs.join(uri, MANIFEST_NAME), manifest.model_dump_json(indent=1).encode(), storage_options, fsync=fsync
        )
    except (AlreadyCommittedError, StorageUnavailableError):
        _remove_own(fs, path, written)
        raise
    except OSError as exc:
        _remove_own(fs, path, written)
        if _committed_meanwhile(fs, manifest_path):  # the winner's cleanup took our temp files
            raise AlreadyCommittedError(
                f"{uri} was committed by another writer while this one wrote it ({exc})"
            ) from exc
        raise _naming(exc, uri) from exc
    except BaseException:
        _remove_own(fs, path, written)
        raise
    if not won:
        _remove_own(fs, path, written)
        raise AlreadyCommittedError(
            f"{uri} was committed by another writer while this one wrote it (concurrent save_batch "
            "of one dataset); this writer's files are removed, the other's dataset stands"
        )
    _clean_after_commit(fs, path, manifest)
    return manifest


def _uncommit(fs: Any, path: str, durable: bool) -> None:
    """Delete the manifest (first: from here on nothing loads), then the shards it named."""
    manifest_path = f"{path}/{MANIFEST_NAME}"
    try:
        old = parse_manifest(fs.cat_file(manifest_path), manifest_path, path)
        names = [s.name for s in old.shards]
    except (FileNotFoundError, CorruptDatasetError):
        names = []
    try:
        fs.rm(manifest_path)
    except FileNotFoundError:
        pass  # another writer uncommitted it first
    if durable:
        sfs.fsync_dir(path)
    sfs.invalidate_cache(fs, path)
    _rm_quiet(fs, [f"{path}/{n}" for n in names])
    sfs.invalidate_cache(fs, path)


def _committed_meanwhile(fs: Any, manifest_path: str) -> bool:
    sfs.invalidate_cache(fs, manifest_path)
    try:
        return bool(fs.exists(manifest_path))
    except Exception:  # noqa: BLE001 - the original error is reported instead
        return False


def _remove_own(fs: Any, path: str, names: Sequence[str]) -> None:
    """Best-effort removal of the shard files this attempt created (it lost or failed)."""
    try:
        _rm_quiet(fs, [f"{path}/{n}" for n in names])
    except Exception:  # noqa: BLE001 - the original error matters more; leftovers never load
        pass
    sfs.invalidate_cache(fs, path)


def _rm_quiet(fs: Any, paths: Sequence[str]) -> None:
    """Delete files, each one whether or not the others (or this one) are still there.

    fsspec's local ``rm`` of a list stops at the first missing file; a concurrent writer may
    have removed some already. S3's bulk delete does not mind missing keys.
    """
    if not paths:
        return
    if isinstance(fs, LocalFileSystem):
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        return
    try:
        fs.rm(list(paths))
    except FileNotFoundError:
        pass


def _naming(exc: OSError, uri: str) -> OSError:
    """An ``OSError`` of the same errno (so the same subclass) whose message names ``uri``."""
    where = exc.filename or ""
    text = exc.strerror or str(exc)
    detail = f"{text} ({where})" if where else text
    if exc.errno:
        return OSError(exc.errno, f"save_batch to {uri} failed: {detail}")
    message = f"save_batch to {uri} failed: {type(exc).__name__}: {exc}"
    try:
        return type(exc)(message)  # keeps e.g. ConnectionError for callers that catch it
    except Exception:  # noqa: BLE001 - a subclass with another constructor
        return OSError(message)

