"""Stateless broadcast groups between trainer and generation workers, and a broadcast dispatcher.

``create_broadcast_group`` builds a process group of its own (a ``TCPStore`` hosted by rank 0
plus a directly constructed ``ProcessGroupGloo``) that never touches the process's default
``torch.distributed`` group, so trainer workers that already run a data-parallel default group
can join a refit group with the generation workers.

Ranks: ``src`` and ``rank`` are always ranks *within the group* (0 .. world_size - 1).

Deadlines: every collective of a :class:`BroadcastGroup` carries the group's timeout. A partner
that never joins or never sends makes the call raise :class:`CollectiveTimeoutError` (a
``TimeoutError`` and a ``RuntimeError``) after about ``timeout_s`` seconds; nothing hangs
forever. This is how the refit task gets its hard deadline.

Backends: ``gloo`` (CPU tensors; tested here). ``nccl`` is wired the same way for CUDA
tensors but is untested on this CPU-only machine.

``start_broadcast`` is the one place that knows how to launch a broadcast on each kind of group
(``torch.distributed`` process groups and backends, :class:`BroadcastGroup`, or any object with
a synchronous ``broadcast(tensor, src)`` such as vLLM's ``PyNcclCommunicator``) and returns a
handle whose ``wait()`` blocks until the tensor may be read or reused.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nrl_tasks.settings import nrl_settings

__all__ = [
    "BroadcastGroup",
    "BroadcastHandle",
    "CollectiveError",
    "CollectiveTimeoutError",
    "create_broadcast_group",
    "find_free_port",
    "get_node_ip",
    "group_device",
    "start_broadcast",
]


class CollectiveError(RuntimeError):
    """A collective (or the rendezvous of a group) failed."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective (or the rendezvous of a group) did not complete within its timeout."""


class BroadcastHandle(Protocol):
    """An in-flight broadcast; ``wait()`` returns once the tensor may be read or reused."""

    def wait(self) -> Any: ...


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text or isinstance(exc, TimeoutError)


def _wrap_error(exc: BaseException, what: str) -> CollectiveError:
    cls = CollectiveTimeoutError if _is_timeout(exc) else CollectiveError
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return cls(f"{what}: {first_line}")


class _DoneHandle:
    """Handle of a broadcast that already completed synchronously."""

    def wait(self) -> bool:
        return True


class _WorkHandle:
    """Wraps a ``torch.distributed`` ``Work``; translates failures into :class:`CollectiveError`."""

    def __init__(self, work: Any, what: str, keep: Any = None) -> None:
        self._work = work
        self._what = what
        self._keep = keep  # keeps the tensor alive while the backend may still touch it
        self._done = False

    def wait(self) -> bool:
        if not self._done:
            try:
                self._work.wait()
            except Exception as exc:  # gloo raises RuntimeError / DistError subclasses
                raise _wrap_error(exc, self._what) from exc
            self._done = True
            self._keep = None
        return True


class _CudaEventHandle:
    """A broadcast enqueued on a CUDA stream; ``wait()`` blocks the host until it finished."""

    def __init__(self, event: Any, keep: Any = None) -> None:
        self._event = event
        self._keep = keep

    def wait(self) -> bool:
        self._event.synchronize()
        self._keep = None
        return True


def _broadcast_options(src: int, timeout: datetime.timedelta | None = None) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = int(src)
    opts.rootTensor = 0
    if timeout is not None:
        opts.timeout = timeout
    return opts


class BroadcastGroup:
    """A stateless broadcast group (own store and process group; default group untouched).

    Attributes: ``rank`` and ``world_size`` (ranks within this group), ``device`` (where its
    tensors must live: CPU for gloo), ``timeout_s`` (deadline of every collective, seconds).
    """

    def __init__(
        self,
        pg: Any,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        backend: str,
    ) -> None:
        self._pg = pg
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.backend = backend
        self.device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise CollectiveError(f"broadcast group (rank {self.rank}/{self.world_size}) is closed")

    def _check_tensor(self, tensor: torch.Tensor, src: int) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast expects a torch.Tensor, got {type(tensor).__name__}")
        if not 0 <= int(src) < self.world_size:
            raise ValueError(f"src={src} is not a rank of this group (world_size={self.world_size})")
        if not tensor.is_contiguous():
            raise ValueError(f"broadcast needs a contiguous tensor, got shape {tuple(tensor.shape)} strides {tensor.stride()}")
        if tensor.device.type != self.device.type:
            raise ValueError(f"{self.backend} broadcast needs {self.device.type} tensors, got one on {tensor.device}")

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> BroadcastHandle:
        """Start broadcasting ``tensor`` (in place) from group rank ``src``; returns a handle."""
        self._check_open()
        self._check_tensor(tensor, src)
        what = (
            f"broadcast of {tensor.numel() * tensor.element_size()} bytes from src {src} "
            f"(rank {self.rank}/{self.world_size}, {self.backend}, timeout {self.timeout_s:g} s) failed"
        )
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            work = self._pg.broadcast([tensor], _broadcast_options(src, timeout))
        except Exception as exc:
            raise _wrap_error(exc, what) from exc
        return _WorkHandle(work, what, keep=tensor)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast ``tensor`` in place from group rank ``src`` and wait for it."""
        self.broadcast_async(tensor, src).wait()

    def barrier(self) -> None:
        """Block until every rank reached the barrier (a one-element broadcast from rank 0)."""
        self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device), 0)

    def close(self) -> None:
        """Shut the process group down and close the store; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            shutdown = getattr(self._pg, "shutdown", None)
            if shutdown is not None:
                shutdown()
        except Exception:  # pragma: no cover - best effort during teardown
            pass
        self._pg = None
        self._store = None  # the store owns (and closes) its listening socket

    def __enter__(self) -> BroadcastGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"BroadcastGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, {state})"


def _is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise CollectiveError(f"cannot listen on {host}:{port} for the broadcast group store: {exc}") from exc
    return sock


def _make_backend(backend: str, store: Any, rank: int, world_size: int, host: str, timeout: datetime.timedelta) -> Any:
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        own_host = "127.0.0.1" if _is_loopback(host) else get_node_ip()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=own_host)]
        opts._threads = 2
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "nccl":  # untested here (no GPU); same shape as gloo
        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ValueError("backend='nccl' needs a CUDA build of torch and a visible GPU")
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, nccl_opts)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def create_broadcast_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    *,
    timeout_s: float = 60.0,
    backend: str = "gloo",
) -> BroadcastGroup:
    """Join (rank 0: host) a stateless broadcast group of ``world_size`` processes.

    Rank 0 binds ``host:port`` itself (use ``127.0.0.1`` on one machine) and serves the
    rendezvous store; the others connect to it. Every rank must call this concurrently. Raises
    :class:`CollectiveTimeoutError` when the partners do not all join within ``timeout_s``
    seconds, and ``ValueError`` for bad arguments.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an int in (0, 65536), got {port!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    timeout = datetime.timedelta(seconds=float(timeout_s))
    where = f"broadcast group at {host}:{port} (rank {rank}/{world_size}, {backend}, timeout {timeout_s:g} s)"
    listen_socket = _listen(host, port) if rank == 0 else None
    try:
        if rank == 0:
            # The store takes ownership of the descriptor it is given and closes it when it is
            # destroyed, so it gets a duplicate; ours is closed as soon as the store exists.
            # (Closing the same descriptor twice raced with its reuse: EBADF at close.)
            store = dist.TCPStore(
                host, port, world_size, True, timeout,
                wait_for_workers=False, master_listen_fd=os.dup(listen_socket.fileno()),
            )
        else:
            store = dist.TCPStore(host, port, world_size, False, timeout)
        pg = _make_backend(backend, store, rank, world_size, host, timeout)
    except ValueError:
        raise
    except Exception as exc:
        err = _wrap_error(exc, f"rendezvous of {where} did not complete")
        if not isinstance(err, CollectiveTimeoutError) and "connect" in str(exc).lower():
            err = CollectiveTimeoutError(str(err))
        raise err from exc
    finally:
        if listen_socket is not None:
            listen_socket.close()
    return BroadcastGroup(pg, store, rank, world_size, float(timeout_s), backend)


#: rendezvous ports are drawn from here up to the kernel's ephemeral range (above Ray's worker
#: ports, 10002-19999 by default)
RENDEZVOUS_PORT_FLOOR = 20000


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, for a rendezvous bound soon after.

    Drawn at random below the kernel's ephemeral range: a port the kernel hands out itself
    (``bind(0)``) is one any outgoing connection on the machine may take before the rendezvous
    binds it (seen as EADDRINUSE with several jobs on one machine); this range only another
    rendezvous could take, and a random draw makes that rare. Falls back to the kernel's pick."""
    import random

    top = _ephemeral_floor()
    draw = random.SystemRandom()
    for _ in range(64 if top - RENDEZVOUS_PORT_FLOOR > 256 else 0):
        port = draw.randrange(RENDEZVOUS_PORT_FLOOR, top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def get_node_ip() -> str:
    """Address other nodes reach this one at: ``NRL_NODE_IP`` if set; Ray's node address on a
    multi-node Ray cluster; otherwise ``127.0.0.1`` (everything runs on one machine)."""
    env = nrl_settings().node_ip
    if env:
        return env
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        try:
            if len([n for n in ray.nodes() if n.get("Alive")]) > 1:
                return str(ray.util.get_node_ip_address())
        except Exception:  # pragma: no cover - GCS unreachable: fall back to local
            pass
    return "127.0.0.1"


def group_device(group: Any) -> torch.device | None:
    """The device a group's tensors live on, or ``None`` when it cannot tell."""
    device = getattr(group, "device", None)
    if device is not None:
        return torch.device(device)
    if isinstance(group, (dist.ProcessGroup, dist.distributed_c10d.Backend)):
        try:
            name = dist.get_backend(group) if isinstance(group, dist.ProcessGroup) else group.name()
        except Exception:
            name = getattr(group, "name", lambda: "")()
        if "nccl" in str(name).lower():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return None


def start_broadcast(
    group: Any,
    tensor: torch.Tensor,
    src: int,
    *,
    stream: Any = None,
) -> BroadcastHandle:
    """Launch an in-place broadcast of ``tensor`` from group rank ``src`` on ``group``.

    ``group``: a ``torch.distributed`` ``ProcessGroup`` / ``Backend`` (asynchronous work),
    an object with ``broadcast_async(tensor, src)`` (:class:`BroadcastGroup`), or any object
    with a synchronous ``broadcast(tensor, src)`` (vLLM's ``PyNcclCommunicator``). With a CUDA
    ``stream`` the broadcast is enqueued on it and the handle waits on a CUDA event.
    """
    if stream is not None:
        with torch.cuda.stream(stream):
            inner = _launch(group, tensor, src)
            if not isinstance(inner, _DoneHandle):
                inner.wait()  # NCCL work: makes `stream` wait for the collective (host not blocked)
            event = torch.cuda.Event()
            event.record(stream)
        return _CudaEventHandle(event, keep=tensor)
    return _launch(group, tensor, src)


def _launch(group: Any, tensor: torch.Tensor, src: int) -> BroadcastHandle:
    if isinstance(group, (dist.ProcessGroup, dist.distributed_c10d.Backend)):
        what = f"broadcast of {tensor.numel() * tensor.element_size()} bytes from group rank {src} failed"
        try:
            work = group.broadcast([tensor], _broadcast_options(src))
        except Exception as exc:
            raise _wrap_error(exc, what) from exc
        return _WorkHandle(work, what, keep=tensor)
    broadcast_async: Callable[..., BroadcastHandle] | None = getattr(group, "broadcast_async", None)
    if broadcast_async is not None:
        return broadcast_async(tensor, src)
    broadcast = getattr(group, "broadcast", None)
    if broadcast is None:
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup or have broadcast(tensor, src); got {type(group).__name__}"
        )
    broadcast(tensor, src)
    return _DoneHandle()
