"""Pipelined broadcasts over reused buffers: the refit's sender and receivers keep a few
broadcasts in flight (:class:`BroadcastPipeline`) on byte buffers a process-wide pool reuses
(:data:`BUFFER_POOL`); used by :mod:`nrl_tasks.utils.packed_tensor` and the refit's
``FlatParamBuckets``. Each broadcast is launched by :func:`~nrl_tasks.utils.collective.start_broadcast`.
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import nullcontext
from typing import Any

import torch

from nrl_tasks.settings import nrl_settings
from nrl_tasks.utils.collective import BroadcastHandle, start_broadcast

__all__ = ["BUFFER_POOL", "BroadcastPipeline", "BufferPool"]


class BufferPool:
    """Process-wide cache of CPU byte buffers, so repeated refits reuse warm (faulted-in) memory.

    Keeps at most ``max_cached_bytes`` bytes (largest dropped first) in at most ``max_cached``
    buffers (smallest dropped first); ``NRL_REFIT_CACHE_BUFFERS=0`` disables caching. CUDA
    buffers are never cached (torch's caching allocator already reuses them).
    """

    def __init__(self, max_cached: int = 4, max_cached_bytes: int = 512 * 1024 * 1024) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self.max_cached = max_cached
        self.max_cached_bytes = max_cached_bytes

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A 1-D uint8 buffer of at least ``nbytes`` on ``device`` (cached one if it fits)."""
        if device.type == "cpu":
            with self._lock:
                fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
                if fits:
                    return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer no broadcast touches any more."""
        if buf.device.type != "cpu" or not nrl_settings().refit_cache_buffers:
            return
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.numel(), reverse=True)
            while self._free and sum(b.numel() for b in self._free) > self.max_cached_bytes:
                self._free.pop(0)  # over the byte cap: drop the largest
            del self._free[self.max_cached :]  # over the count: drop the smallest

    def clear(self) -> int:
        """Drop every cached buffer; returns the bytes released."""
        with self._lock:
            freed = sum(b.numel() for b in self._free)
            self._free.clear()
        return freed


BUFFER_POOL = BufferPool()


class BroadcastPipeline:
    """At most ``max_in_flight`` broadcasts in flight on ``group``, oldest retired first.

    Owns the byte buffers it hands out with :meth:`acquire` (at most ``max_in_flight`` of them
    while the caller follows acquire -> launch -> release). On CUDA each launch goes on its own
    stream of ``max_in_flight`` alternating streams, ordered after the current stream's work.
    """

    def __init__(self, group: Any, src: int, max_in_flight: int, target: int, device: torch.device) -> None:
        self.group, self.src, self.max_in_flight, self.target = group, src, max_in_flight, target
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._free: list[torch.Tensor] = []
        self._inflight: deque[tuple[BroadcastHandle, torch.Tensor | None, Any]] = deque()
        self._streams = _cuda_streams(device, max_in_flight) if device.type == "cuda" else []
        self._launches = 0
        self.max_seen_in_flight = 0

    @property
    def uses_streams(self) -> bool:
        return bool(self._streams)

    def stream_context(self) -> Any:
        """Context for the next launch's copies: its CUDA stream (after current work), or nothing."""
        if not self._streams:
            return nullcontext()
        stream = self._streams[self._launches % len(self._streams)]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def pending(self) -> int:
        return len(self._inflight)

    def make_room(self) -> None:
        """Wait for the oldest broadcasts until fewer than ``max_in_flight`` are in flight."""
        while len(self._inflight) >= self.max_in_flight:
            buf, _ = self.next_done()
            self.release(buf)

    def acquire(self, nbytes: int, exact: bool = False) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (``max(nbytes, target)`` when newly made, unless ``exact``)."""
        for i, buf in enumerate(self._free):
            if buf.numel() >= nbytes:
                return self._free.pop(i)
        if self._free:  # every free one is too small (last or legacy chunk): swap one out
            BUFFER_POOL.give(self._free.pop())
        return BUFFER_POOL.take(nbytes if exact else max(nbytes, self.target), self.device)

    def launch(self, data: torch.Tensor, buf: torch.Tensor | None, tag: Any = None) -> None:
        """Start broadcasting ``data`` (a slice of ``buf``, or ``buf=None`` for a caller-owned tensor)."""
        stream = self._streams[self._launches % len(self._streams)] if self._streams else None
        self._launches += 1
        handle = start_broadcast(self.group, data, self.src, stream=stream)
        self._inflight.append((handle, buf, tag))
        self.max_seen_in_flight = max(self.max_seen_in_flight, len(self._inflight))

    def next_done(self) -> tuple[torch.Tensor | None, Any]:
        """Wait for the oldest broadcast; returns its ``(buf, tag)``; the caller then releases ``buf``."""
        handle, buf, tag = self._inflight[0]
        handle.wait()
        self._inflight.popleft()
        return buf, tag

    def release(self, buf: torch.Tensor | None) -> None:
        if buf is not None:
            self._free.append(buf)

    def close(self, ok: bool) -> None:
        """Wait for everything in flight (errors re-raised only if ``ok``); return buffers to the pool.

        After a failed broadcast the buffers are not reused: the backend may still hold them.
        """
        failed = False
        while self._inflight:
            try:
                buf, _ = self.next_done()
                self.release(buf)
            except Exception:
                self._inflight.popleft()
                failed = True
                if ok:
                    self._free.clear()
                    raise
        if self._streams and not failed:
            # callers may still have copies out of our buffers queued on their stream
            torch.cuda.synchronize(self.device)
        if not failed:
            for buf in self._free:
                BUFFER_POOL.give(buf)
        self._free.clear()


_STREAMS: dict[tuple[int, int], list[Any]] = {}


def _cuda_streams(device: torch.device, count: int) -> list[Any]:
    """``count`` side streams for ``device``, created once per process: the caching allocator
    keys blocks by stream, so fresh streams on every refit would strand cached memory."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, count)
    if key not in _STREAMS:
        _STREAMS[key] = [torch.cuda.Stream(device=index) for _ in range(count)]
    return _STREAMS[key]
