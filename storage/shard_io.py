"""Writing and reading single shard files (Arrow IPC, uncompressed) with their checksums.

Writes hash the bytes as they are produced (no second pass over the file). Local reads map the
file copy-on-write (``mmap.ACCESS_COPY``): tensors decoded from it are zero-copy views that
may be written in place, and such writes stay private to the process (the file never
changes). Other reads land in writable numpy byte arrays.
"""

from __future__ import annotations

import mmap as _mmap
import os
from typing import Any, Literal, Optional

import numpy as np
import pyarrow as pa

from storage.checksum import digest, new_hasher
from storage.errors import CorruptDatasetError, MissingShardError
from storage.fs import commit_local, local_temp_path
from storage.manifest import ShardInfo

__all__ = ["VerifyMode", "check_shard", "open_local_shard", "read_table", "serialize", "write_local"]

VerifyMode = Literal["full", "size", "none"]


class _HashingSink:
    """A binary file wrapper that hashes every byte written through it."""

    def __init__(self, raw: Any, algorithm: str) -> None:
        self._raw = raw
        self._hasher = new_hasher(algorithm)
        self._pos = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._hasher.update(view)
        written = 0
        while written < view.nbytes:  # raw (unbuffered) writes may be partial
            written += self._raw.write(view[written:])
        self._pos += written
        return written

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


def _write_ipc(sink: Any, schema: pa.Schema, table: pa.Table) -> None:
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_table(table)


def write_local(
    path: str, schema: pa.Schema, table: pa.Table, algorithm: str, *, fsync: bool = True
) -> tuple[int, str]:
    """Write one shard atomically (temp file, fsync, rename); returns ``(bytes, checksum)``.

    The directory fsync is left to the caller (once for all shards). ``fsync=False`` skips
    the file's fsync (see ``save_batch``).
    """
    tmp = local_temp_path(path)
    try:
        with open(tmp, "wb", buffering=0) as raw:
            sink = _HashingSink(raw, algorithm)
            _write_ipc(pa.PythonFile(sink, mode="w"), schema, table)
            if fsync:
                os.fsync(raw.fileno())
        size = os.path.getsize(tmp)
        if size != sink.tell():
            raise OSError(f"short write to {tmp}: {size} of {sink.tell()} bytes")
        commit_local(tmp, path, durable=False)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return size, sink.hexdigest()


def serialize(schema: pa.Schema, table: pa.Table, algorithm: str) -> tuple[pa.Buffer, str]:
    """One shard as an in-memory buffer (for object stores) and its checksum."""
    mock = pa.MockOutputStream()
    _write_ipc(mock, schema, table)
    buf = pa.allocate_buffer(mock.size())
    _write_ipc(pa.FixedSizeBufferWriter(buf), schema, table)
    return buf, digest(buf, algorithm)


def check_shard(data: Any, info: ShardInfo, where: str, mode: VerifyMode, algorithm: str) -> None:
    """Size (``"size"``) or size and checksum (``"full"``) of a shard's bytes vs the manifest."""
    if mode == "none":
        return
    size = memoryview(data).nbytes
    if size != info.bytes:
        raise CorruptDatasetError(
            f"shard {where} has {size} bytes, manifest says {info.bytes} (truncated or replaced)"
        )
    if mode == "full":
        found = digest(data, algorithm)
        if found != info.checksum:
            raise CorruptDatasetError(
                f"shard {where} fails its {algorithm} checksum: {found} != {info.checksum} "
                "(corrupted or modified)"
            )


def open_local_shard(path: str, info: ShardInfo, mode: VerifyMode, algorithm: str, use_mmap: bool) -> Any:
    """The shard's bytes: a copy-on-write mmap (``use_mmap``) or a numpy byte array; verified."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise MissingShardError(f"shard {path} is missing (named by the manifest)") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if mode != "none" and size != info.bytes:
            raise CorruptDatasetError(
                f"shard {path} has {size} bytes, manifest says {info.bytes} (truncated or replaced)"
            )
        if size == 0:
            raise CorruptDatasetError(f"shard {path} is empty")
        if use_mmap:
            data: Any = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_COPY)
        else:
            data = np.empty(size, dtype=np.uint8)  # not zero-filled, unlike bytearray(size)
            if f.readinto(memoryview(data)) != size:
                raise CorruptDatasetError(f"shard {path} changed size while being read")
    check_shard(data, info, path, mode, algorithm)
    return data


def read_table(data: Any, where: str, expected_rows: Optional[int]) -> pa.Table:
    """The Arrow table of one shard's bytes (zero-copy); ``CorruptDatasetError`` if unreadable."""
    try:
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
        table.schema.names  # noqa: B018 - decodes the column names (UTF-8)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        raise CorruptDatasetError(f"shard {where} is not a readable Arrow IPC file: {exc}") from exc
    if expected_rows is not None and table.num_rows != expected_rows:
        raise CorruptDatasetError(
            f"shard {where} holds {table.num_rows} rows, manifest says {expected_rows}"
        )
    return table
