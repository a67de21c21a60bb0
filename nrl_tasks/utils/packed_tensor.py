"""Packed broadcast of named tensors from a trainer to generation workers (seed 004 API).

Wire format: the raw bytes of each tensor (after ``post_iter_func``), back to back with no
padding, cut into chunks; each chunk is one broadcast. Chunk boundaries depend only on the
byte sizes of the tensors and on the target size, so the consumer re-derives them from the
metadata ``(name, (shape, dtype))``; both sides must agree on order, dtypes, shapes and target.

Cut rules (``T`` = ``buffer_size_bytes``):

* default: a chunk never exceeds ``T``; it is cut before the tensor that would make it exceed
  ``T``. A tensor larger than ``T`` travels in a broadcast of its own. The producer sends any
  chunk of a single contiguous tensor straight from that tensor's storage (no pack copy).
* ``use_legacy_packing=True`` (vLLM's own consumer): a tensor is appended first, and the chunk is
  cut once its size exceeds ``T``, so an oversized tensor is packed with the ones before it.

Pipelining: ``num_buffers`` byte buffers alternate; at most ``num_buffers`` broadcasts are in
flight per side, so packing (or unpacking) buffer ``k+1`` overlaps the broadcast of buffer ``k``
(asynchronous gloo work on CPU, one CUDA stream per buffer on GPU); memory stays bounded by
``num_buffers`` buffers plus the tensors being sent. Each side's buffer count is its own
choice. Both sides wait for every in-flight broadcast before returning.

``group`` and ``src``: see :func:`nrl_tasks.utils.collective.start_broadcast`; ``src`` is a rank
*within* ``group`` (the group rank, not the global rank).

CPU buffers are kept in a small process-wide pool and reused by later calls (fresh
allocations cost page faults on every refit); :func:`release_packed_buffers` frees them and
``NRL_REFIT_CACHE_BUFFERS=0`` disables the pool.

The consumer's callback mode receives each batch into a fresh buffer, so a callback may keep its
tensors (callers ported from NeMo-RL do); ``reuse_buffers=True`` (not in NeMo-RL) opts in to the
pooled, reused buffers, for callbacks that copy the tensors out before returning.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from nrl_tasks.settings import NrlSettings, nrl_settings
from nrl_tasks.utils.broadcast_pipeline import BUFFER_POOL, BroadcastPipeline
from nrl_tasks.utils.collective import group_device
from nrl_tasks.utils.refit import FlatParamBuckets

__all__ = [
    "CPU_DEFAULT_TARGET_BYTES",
    "FlatParamBuckets",
    "get_num_buffers",
    "get_target_packed_tensor_size",
    "packed_broadcast_consumer",
    "packed_broadcast_producer",
    "release_packed_buffers",
]

#: Target chunk size on CPU (gloo). Chosen with ``python -m benchmarks.bench_refit --sweep`` on
#: the 2-core dev machine: 2-8 MiB chunks were consistently fastest, 32-64 MiB ones 2-3x slower.
#: On CPU the copies compete with the transport for the same cores, so small chunks win: the
#: receive buffer is still in cache when it is unpacked, and every tensor larger than the target
#: is sent straight from its own storage (no pack copy).
CPU_DEFAULT_TARGET_BYTES = 4 * 1024 * 1024
GPU_MAX_TARGET_BYTES = 5 * 1024**3
DEFAULT_MEMORY_RATIO: float = NrlSettings.model_fields["refit_buffer_memory_ratio"].default
DEFAULT_NUM_BUFFERS: int = NrlSettings.model_fields["refit_num_buffers"].default


def get_target_packed_tensor_size() -> int:
    """Target chunk size in bytes.

    ``NRL_REFIT_BUFFER_SIZE_BYTES`` if set; on CUDA ``NRL_REFIT_BUFFER_MEMORY_RATIO``
    (default 0.02) of the device's total memory, capped at 5 GiB; otherwise
    :data:`CPU_DEFAULT_TARGET_BYTES` (4 MiB).
    """
    settings = nrl_settings()
    if settings.refit_buffer_size_bytes is not None:
        return settings.refit_buffer_size_bytes
    if torch.cuda.is_available():
        ratio = settings.refit_buffer_memory_ratio
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return max(1, min(int(total * ratio), GPU_MAX_TARGET_BYTES))
    return CPU_DEFAULT_TARGET_BYTES


def get_num_buffers() -> int:
    """Number of alternating buffers: ``NRL_REFIT_NUM_BUFFERS``, default 2."""
    return nrl_settings().refit_num_buffers


def _resolve(buffer_size_bytes: int | None, num_buffers: int | None) -> tuple[int, int]:
    target = get_target_packed_tensor_size() if buffer_size_bytes is None else buffer_size_bytes
    count = get_num_buffers() if num_buffers is None else num_buffers
    if isinstance(target, bool) or not isinstance(target, int) or target < 1:
        raise ValueError(f"buffer_size_bytes must be a positive int, got {buffer_size_bytes!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"num_buffers must be a positive int, got {num_buffers!r}")
    return target, count


# ---------------------------------------------------------------------------------------------
# Chunk planning (shared by both sides, so their boundaries agree by construction)


@dataclass
class _Piece:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    offset: int = 0
    payload: torch.Tensor | None = None  # producer side: the tensor to send


@dataclass
class _Chunk:
    pieces: list[_Piece]
    nbytes: int
    solo: bool = False  # an oversized tensor in a broadcast of its own
    final: bool = False  # flushed at the end of the stream
    keep: list[Any] = field(default_factory=list)


class _ChunkPlanner:
    def __init__(self, target: int, legacy: bool) -> None:
        self.target, self.legacy = target, legacy
        self._pieces: list[_Piece] = []
        self._nbytes = 0

    def _flush(self, final: bool = False) -> list[_Chunk]:
        if not self._pieces:
            return []
        chunk = _Chunk(self._pieces, self._nbytes, final=final)
        self._pieces, self._nbytes = [], 0
        return [chunk]

    def _append(self, piece: _Piece) -> None:
        piece.offset = self._nbytes
        self._pieces.append(piece)
        self._nbytes += piece.nbytes

    def add(self, piece: _Piece) -> list[_Chunk]:
        """Add the next tensor; returns the chunks it completed, in wire order."""
        if self.legacy:
            self._append(piece)
            return self._flush() if self._nbytes > self.target else []
        if piece.nbytes > self.target:
            return self._flush() + [_Chunk([piece], piece.nbytes, solo=True)]
        done = self._flush() if self._nbytes + piece.nbytes > self.target else []
        self._append(piece)
        return done

    def finish(self) -> list[_Chunk]:
        return self._flush(final=True)


def release_packed_buffers() -> int:
    """Free the cached CPU buffers; returns the number of bytes released."""
    return BUFFER_POOL.clear()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a contiguous 1-D uint8 tensor (a view when already contiguous)."""
    flat = tensor.detach().reshape(-1)
    if flat.stride(0) != 1:  # not contiguous, or 0/1 elements with any stride (x[:, 0] of [1, S])
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Producer


def _pack_into(out: torch.Tensor, piece: _Piece) -> None:
    if piece.nbytes == 0:
        return
    dst = out[piece.offset : piece.offset + piece.nbytes]
    src = piece.payload
    assert src is not None
    if piece.offset % piece.dtype.itemsize == 0:
        dst.view(piece.dtype).view(piece.shape).copy_(src)  # one copy, also from non-contiguous
    else:
        dst.copy_(_as_bytes(src))  # misaligned for this dtype: copy its bytes


def packed_broadcast_producer(
    iterator: Iterable[tuple[str, torch.Tensor]],
    group: Any,
    src: int,
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None,
    *,
    buffer_size_bytes: int | None = None,
    num_buffers: int | None = None,
    use_legacy_packing: bool = False,
) -> None:
    """Broadcast the ``(name, tensor)`` items of ``iterator`` from group rank ``src``, packed.

    ``post_iter_func((name, tensor)) -> tensor`` runs on each item first (cast, gather); its
    output's bytes are what travel, so the consumer's metadata must carry its shape and dtype.
    Returns once every broadcast completed. An empty iterator sends nothing.
    """
    target, count = _resolve(buffer_size_bytes, num_buffers)
    planner = _ChunkPlanner(target, use_legacy_packing)
    pipe: BroadcastPipeline | None = None
    ok = False
    try:
        with torch.no_grad():
            for item in iterator:
                if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                    raise TypeError(f"producer iterator must yield (name, tensor) pairs, got {type(item).__name__}")
                tensor = post_iter_func(item) if post_iter_func is not None else item[1]
                if not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"post_iter_func returned {type(tensor).__name__} for {item[0]!r}, expected a torch.Tensor")
                piece = _Piece(item[0], tuple(tensor.shape), tensor.dtype, tensor.numel() * tensor.element_size(), payload=tensor)
                for chunk in planner.add(piece):
                    pipe = pipe or BroadcastPipeline(group, src, count, target, group_device(group) or tensor.device)
                    _send(pipe, chunk)
            for chunk in planner.finish():
                assert chunk.pieces[0].payload is not None
                pipe = pipe or BroadcastPipeline(group, src, count, target, group_device(group) or chunk.pieces[0].payload.device)
                _send(pipe, chunk)
        ok = True
    finally:
        if pipe is not None:
            pipe.close(ok)


def _send(pipe: BroadcastPipeline, chunk: _Chunk) -> None:
    pipe.make_room()
    with pipe.stream_context():
        first = chunk.pieces[0].payload
        assert first is not None
        if len(chunk.pieces) == 1 and first.is_contiguous() and first.device == pipe.device:
            data, buf = _as_bytes(first), None  # a chunk of one tensor: send it from its own storage
        else:
            buf = pipe.acquire(chunk.nbytes, exact=chunk.final)
            data = buf[: chunk.nbytes]
            for piece in chunk.pieces:
                _pack_into(data, piece)
        if pipe.uses_streams:  # copies are still queued on the stream: keep their sources alive
            chunk.keep = [p.payload for p in chunk.pieces] + [data]
        for piece in chunk.pieces:
            piece.payload = None
    pipe.launch(data, buf, chunk)


# ---------------------------------------------------------------------------------------------
# Consumer


def _parse_meta(item: Any) -> _Piece:
    try:
        name, (shape, dtype) = item
    except (TypeError, ValueError):
        raise TypeError(f"consumer iterator must yield (name, (shape, dtype)), got {item!r}") from None
    if not isinstance(name, str):
        raise TypeError(f"parameter name must be a str, got {name!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype of {name!r} must be a torch.dtype, got {dtype!r}")
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise TypeError(f"shape of {name!r} must be a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape of {name!r} has a negative dimension: {dims}")
    return _Piece(name, dims, dtype, math.prod(dims) * dtype.itemsize)


def _unpack(chunk: _Chunk, data: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    for p in chunk.pieces:
        if p.nbytes == 0:
            tensor = torch.empty(p.shape, dtype=p.dtype, device=data.device)
        elif p.offset % p.dtype.itemsize == 0:
            tensor = data[p.offset : p.offset + p.nbytes].view(p.dtype).view(p.shape)
        else:  # realign: a fresh tensor owned by the caller
            tensor = torch.empty(p.shape, dtype=p.dtype, device=data.device)
            tensor.view(-1).view(torch.uint8).copy_(data[p.offset : p.offset + p.nbytes])
        out.append((p.name, tensor))
    return out


def _packed_broadcast_consumer_batches(
    iterator: Iterable[Any],
    group: Any,
    src: int,
    *,
    num_buffers: int | None = None,
    buffer_size_bytes: int | None = None,
    use_legacy_packing: bool = False,
    reuse_buffers: bool = True,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield unpacked batches ``[(name, tensor)]`` while keeping ownership of the receive buffers.

    Tensors of a batch are views into a receive buffer (misaligned ones are fresh copies) and
    stay valid only until the next batch is requested: copy what you keep. With
    ``reuse_buffers=False`` every batch gets a fresh buffer instead, and its tensors stay valid.
    Nothing is received until the first batch is requested.
    """
    target, count = _resolve(buffer_size_bytes, num_buffers)
    return _consume(iter(iterator), group, src, target, count, use_legacy_packing, reuse_buffers)


def _consume(
    meta: Iterator[Any], group: Any, src: int, target: int, count: int, legacy: bool, reuse: bool
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    planner = _ChunkPlanner(target, legacy)
    planned: deque[_Chunk] = deque()
    exhausted = False
    device = group_device(group) or torch.device("cpu")
    pipe = BroadcastPipeline(group, src, count, target, device)

    def issue_next() -> bool:
        nonlocal exhausted
        while not planned:
            if exhausted:
                return False
            try:
                item = next(meta)
            except StopIteration:
                exhausted = True
                planned.extend(planner.finish())
                continue
            planned.extend(planner.add(_parse_meta(item)))
        chunk = planned.popleft()
        with pipe.stream_context():  # reused: oversized tensors too land in a pooled buffer
            buf = pipe.acquire(chunk.nbytes, exact=chunk.final) if reuse else None
        if buf is None:  # fresh: the caller's to keep, allocated on its (current) stream
            data = torch.empty(chunk.nbytes, dtype=torch.uint8, device=pipe.device)
        else:
            data = buf[: chunk.nbytes]
        pipe.launch(data, buf, (chunk, data))
        return True

    ok = False
    try:
        while pipe.pending() < count and issue_next():
            pass
        while pipe.pending():
            buf, (chunk, data) = pipe.next_done()
            batch = _unpack(chunk, data)
            yield batch
            del batch
            pipe.release(buf)
            while pipe.pending() < count and issue_next():
                pass
        ok = True
    finally:
        pipe.close(ok)


def packed_broadcast_consumer(
    iterator: Iterable[Any],
    group: Any,
    src: int,
    post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None] | None,
    return_iterator: bool = False,
    *,
    num_buffers: int | None = None,
    buffer_size_bytes: int | None = None,
    use_legacy_packing: bool = False,
    reuse_buffers: bool = False,
) -> Iterator[tuple[str, torch.Tensor]] | None:
    """Receive what :func:`packed_broadcast_producer` sends; ``iterator`` yields ``(name, (shape, dtype))``.

    Calls ``post_unpack_func(batch)`` per received batch and returns ``None``. Each batch is
    received into a fresh buffer, so the callback may keep its tensors without copying them.
    ``reuse_buffers=True`` receives into the pooled, reused buffers instead (no allocation per
    batch): the batch's tensors are then views that later batches overwrite, so the callback
    must copy what it keeps before it returns (e.g. ``param.copy_(tensor)``).

    With ``return_iterator=True``, returns a lazy flat iterator of ``(name, tensor)`` (for vLLM's
    ``reload_weights``) that always reuses its buffers: a tensor stays valid until the iterator
    moves past its batch (``reuse_buffers`` is ignored).
    """
    batches = _packed_broadcast_consumer_batches(
        iterator, group, src, num_buffers=num_buffers, buffer_size_bytes=buffer_size_bytes,
        use_legacy_packing=use_legacy_packing, reuse_buffers=reuse_buffers or return_iterator,
    )
    if return_iterator:
        return (named for batch in batches for named in batch)
    if post_unpack_func is None:
        raise TypeError("post_unpack_func is required unless return_iterator=True")
    for batch in batches:
        post_unpack_func(batch)
    return None
