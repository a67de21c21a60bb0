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
from storage.atomic import commit_local, local_temp_path
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


#: Decoded bytes allowed per byte of shard file. Shards are written uncompressed (every Arrow
#: buffer is a slice of the file), so anything near this is forged: Arrow would otherwise
#: allocate what a compressed buffer's header claims (68 KB of zstd asked for 6.4 GB).
MAX_EXPANSION = 16
_MIN_LIMIT = 1 << 20


class _Flat:
    """Just enough of a FlatBuffers reader for Arrow's IPC ``Footer`` and ``Message`` tables.

    Every read is bounds-checked (``ValueError``): the bytes are untrusted.
    """

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf

    def _int(self, pos: int, size: int, signed: bool) -> int:
        if pos < 0 or pos + size > len(self.buf):
            raise ValueError(f"flatbuffer read at {pos} outside {len(self.buf)} bytes")
        return int.from_bytes(self.buf[pos : pos + size], "little", signed=signed)

    def root(self) -> int:
        return self._int(0, 4, False)

    def field(self, table: int, index: int) -> Optional[int]:
        """Position of field ``index`` of the table at ``table``, ``None`` when absent."""
        vtable = table - self._int(table, 4, True)
        vsize = self._int(vtable, 2, False)
        slot = 4 + 2 * index
        if slot + 2 > vsize:
            return None
        offset = self._int(vtable + slot, 2, False)
        return table + offset if offset else None

    def ref(self, pos: int) -> int:
        return pos + self._int(pos, 4, False)

    def vector(self, table: int, index: int) -> tuple[int, int]:
        """``(position of the first element, length)`` of a vector field (``(0, 0)`` if absent)."""
        pos = self.field(table, index)
        if pos is None:
            return 0, 0
        vec = self.ref(pos)
        return vec + 4, self._int(vec, 4, False)

    def i64(self, pos: int) -> int:
        return self._int(pos, 8, True)

    def u8(self, pos: int) -> int:
        return self._int(pos, 1, False)


def _declared_bytes(buf: pa.Buffer) -> int:
    """What Arrow would allocate to decode every batch of an IPC file, from its metadata alone.

    Uncompressed batches are zero-copy slices (counted by their length, all within the file);
    for a compressed one each buffer starts with its uncompressed length (int64, -1: stored raw).
    """
    view = memoryview(buf)
    if len(view) < 16 or bytes(view[-6:]) != b"ARROW1":
        raise ValueError("no Arrow IPC file trailer")
    footer_len = int.from_bytes(view[-10:-6], "little", signed=True)
    if not 0 < footer_len <= len(view) - 16:
        raise ValueError(f"footer length {footer_len} out of range")
    footer = _Flat(view[len(view) - 10 - footer_len : len(view) - 10])
    root = footer.root()
    total = 0
    for field in (2, 3):  # dictionaries, recordBatches: [Block {offset: i64, metaDataLength: i32, bodyLength: i64}]
        start, count = footer.vector(root, field)
        for i in range(count):
            block = start + 24 * i
            offset = footer.i64(block)
            message = pa.ipc.read_message(pa.BufferReader(buf.slice(offset)))
            total += _message_bytes(message)
    return total


def _message_bytes(message: Any) -> int:
    meta = _Flat(memoryview(message.metadata))
    root = meta.root()
    header_type = meta.field(root, 1)
    header = meta.field(root, 2)
    if header_type is None or header is None:
        return 0
    kind = meta.u8(header_type)
    table = meta.ref(header)
    if kind == 2:  # DictionaryBatch {id, data: RecordBatch, isDelta}
        data = meta.field(table, 1)
        if data is None:
            return 0
        table = meta.ref(data)
    elif kind != 3:  # not a RecordBatch
        return 0
    body = memoryview(message.body)
    compressed = meta.field(table, 3) is not None  # RecordBatch.compression
    start, count = meta.vector(table, 2)  # buffers: [Buffer {offset: i64, length: i64}]
    total = 0
    for i in range(count):
        offset, length = meta.i64(start + 16 * i), meta.i64(start + 16 * i + 8)
        if offset < 0 or length < 0 or offset + length > len(body):
            raise ValueError(f"buffer {i} ({offset}, {length}) outside a body of {len(body)} bytes")
        if not compressed or length == 0:
            total += length
            continue
        if length < 8:
            raise ValueError(f"compressed buffer {i} of {length} bytes has no length prefix")
        declared = int.from_bytes(body[offset : offset + 8], "little", signed=True)
        if declared < -1:
            raise ValueError(f"compressed buffer {i} declares {declared} bytes")
        total += length - 8 if declared == -1 else declared
    return total


def check_decoded_size(data: Any, where: str) -> None:
    """Refuse, before Arrow allocates anything, a shard whose batches would decode to more
    than ``MAX_EXPANSION`` times its file size (compressed bodies declaring huge buffers)."""
    buf = pa.py_buffer(data)
    limit = max(buf.size * MAX_EXPANSION, _MIN_LIMIT)
    try:
        declared = _declared_bytes(buf)
    except (ValueError, pa.ArrowException, OSError) as exc:
        raise CorruptDatasetError(f"shard {where} is not a readable Arrow IPC file: {exc}") from None
    if declared > limit:
        raise CorruptDatasetError(
            f"shard {where} would decode to {declared} bytes from a {buf.size}-byte file (limit {limit}: "
            f"{MAX_EXPANSION}x its size); refused before allocating (forged or foreign compressed data)"
        )


def read_table(data: Any, where: str, expected_rows: Optional[int]) -> pa.Table:
    """The Arrow table of one shard's bytes (zero-copy); ``CorruptDatasetError`` if unreadable.

    The decoded size is bounded first (:func:`check_decoded_size`).
    """
    check_decoded_size(data, where)
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
