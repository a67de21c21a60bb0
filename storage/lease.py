"""A run lease: one writer per run, on local disk and S3, released when its holder dies.

Layout: lease files ``<prefix>/lease-000001.json``, ``lease-000002.json``, ... each created
create-only (``storage.fs.create_only``: ``os.link`` locally, ``If-None-Match: *`` on S3). The
holder is the writer of the highest-numbered file (its *generation*). Taking the lease from a
dead (or released) holder of generation ``n`` creates ``lease-{n+1}``: of two contenders only
one succeeds, the other sees a live holder and is refused. Numbers are never reused: a release
marks the holder's own file ``released``, it deletes nothing; a new holder prunes files older
than the last few.

The holder heartbeats by rewriting its own file (``heartbeat_at``) every ``heartbeat_s`` from a
daemon thread. Before each heartbeat it looks for a higher-numbered file: if there is one it
has been *fenced* (taken over), sets ``lost``, calls ``on_lost`` and stops; callers check
:meth:`RunLease.ensure_held` before they commit work.

A lease file that cannot be read (empty or garbled: a heartbeat cut by a power loss on a
filesystem that lost the unsynced data) raises :class:`LeaseUnreadableError` naming it: whether
its writer lives cannot be told, so only ``acquire(take_over=True)`` passes it (the operator's
decision, as for a live-looking holder). Heartbeats are written like every other file here:
temp file, fsync, rename, directory fsync.

A holder is dead when it released the lease, when its heartbeat is older than its ``ttl_s``
(by the reader's clock: keep clocks of hosts within a fraction of ``ttl_s``), or, seen from the
same host and PID namespace, when its process is gone (``psutil``; the process create time is
compared too, so a reused pid is not taken for the holder).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Mapping, Optional

import psutil

from storage import fs as sfs

__all__ = [
    "LeaseHeldError",
    "LeaseHolder",
    "LeaseLostError",
    "LeaseUnreadableError",
    "RunLease",
    "lease_is_live",
    "read_lease",
]

log = logging.getLogger(__name__)

FORMAT = "nrl-run-lease/1"
KEEP_FILES = 4  # lease files kept by a new holder (older ones are pruned)
_NAME_RE = re.compile(r"^lease-(\d{6,})\.json$")
_CREATE_TIME_TOLERANCE_S = 0.05


def lease_name(generation: int) -> str:
    """File name of lease generation ``generation``.

    >>> lease_name(7)
    'lease-000007.json'
    """
    return f"lease-{generation:06d}.json"


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _create_time(pid: int) -> Optional[float]:
    """Create time of a running (not zombie) process, ``None`` when there is none."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(proc.create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


class LeaseUnreadableError(ValueError):
    """A lease file that is not a readable lease record (empty, garbled, another format);
    ``path`` names it, ``reason`` says what is wrong. Whose lease it was, and whether that
    writer lives, cannot be told: :meth:`RunLease.acquire` passes it only with ``take_over=True``."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"lease file {path} is unreadable: {reason}")


#: the JSON types of a lease record's fields (bool is refused where a number is wanted)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "generation": (int,), "host": (str,), "pid": (int,), "pid_create_time": (int, float), "pid_namespace": (str,),
    "flow_run_id": (str, type(None)), "acquired_at": (int, float), "heartbeat_at": (int, float),
    "ttl_s": (int, float), "token": (str,), "released": (bool,),
}


def _check_record(data: Any) -> dict[str, Any]:
    """The known fields of a decoded lease record; ``ValueError`` saying what is wrong with it."""
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    if data.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} file")
    out = {}
    for key, types in _FIELD_TYPES.items():  # newer writers may add fields: those are left out
        if key not in data:
            if key == "released":
                continue
            raise ValueError(f"field {key!r} is missing")
        value = data[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ValueError(f"field {key!r} is {value!r:.40}, expected {' or '.join(t.__name__ for t in types)}")
        out[key] = value
    return out


@dataclass(frozen=True)
class LeaseHolder:
    """What one lease file says about its writer."""

    generation: int
    host: str
    pid: int
    pid_create_time: float  # psutil create time of ``pid``: tells a reused pid apart
    pid_namespace: str  # inode of /proc/self/ns/pid: "same host" needs the same one
    flow_run_id: Optional[str]
    acquired_at: float  # wall clock (time.time()) of the holder
    heartbeat_at: float
    ttl_s: float
    token: str  # unique per acquisition
    released: bool = False

    def describe(self, now: Optional[float] = None) -> str:
        """``"host h pid 123 flow run <id>, heartbeat 3 s ago"``."""
        now = time.time() if now is None else now
        run = f" flow run {self.flow_run_id}" if self.flow_run_id else ""
        state = "released" if self.released else f"heartbeat {max(0.0, now - self.heartbeat_at):.0f} s ago"
        return f"host {self.host} pid {self.pid}{run}, {state} (generation {self.generation}, ttl {self.ttl_s:g} s)"

    def is_local(self) -> bool:
        """Whether this process can check the holder's pid (same host, same PID namespace)."""
        return self.host == socket.gethostname() and self.pid_namespace == _pid_namespace()

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "LeaseHolder":
        """The record of lease file ``where`` (its bytes ``raw``); :class:`LeaseUnreadableError`
        when they are empty, not JSON or not a lease record."""
        if not raw.strip():
            raise LeaseUnreadableError(where, "the file is empty")
        try:
            return cls(**_check_record(json.loads(raw)))
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError too
            raise LeaseUnreadableError(where, str(exc)) from None


class LeaseHeldError(RuntimeError):
    """Another live writer holds the run lease; ``holder`` says who."""

    def __init__(self, prefix_uri: str, holder: LeaseHolder) -> None:
        self.holder = holder
        super().__init__(
            f"the run at {prefix_uri} is held by {holder.describe()}: one writer per run. If that "
            f"process is dead on another host, wait until its heartbeat is {holder.ttl_s:g} s old "
            "(it is then taken over automatically), or take over now with take_over=True "
            "(RunLease.acquire(take_over=True)): the old holder is fenced and stops at its next heartbeat"
        )


class LeaseLostError(RuntimeError):
    """This process held the run lease and another one has taken it over (fenced)."""


def _generations(prefix_uri: str, storage_options: Optional[Mapping[str, Any]]) -> list[int]:
    out = []
    for name in sfs.list_dir(prefix_uri, storage_options):
        m = _NAME_RE.match(name)
        if m:
            out.append(int(m.group(1)))
    return sorted(out)


def _read(prefix_uri: str, generation: int, storage_options: Optional[Mapping[str, Any]]) -> Optional[LeaseHolder]:
    target = sfs.join(prefix_uri, lease_name(generation))
    try:
        raw = sfs.read_bytes(target, storage_options)
    except FileNotFoundError:
        return None  # pruned meanwhile
    holder = LeaseHolder.from_json(raw, target)
    if holder.generation != generation:
        raise LeaseUnreadableError(target, f"it says generation {holder.generation}")
    return holder


def _current(
    prefix_uri: str, generations: list[int], storage_options: Optional[Mapping[str, Any]]
) -> Optional[LeaseHolder]:
    """The record of the highest-numbered of ``generations`` still there (``None``: none is);
    :class:`LeaseUnreadableError` when that file cannot be read."""
    for generation in reversed(generations):
        holder = _read(prefix_uri, generation, storage_options)
        if holder is not None:
            return holder
    return None


def read_lease(
    prefix_uri: str, storage_options: Optional[Mapping[str, Any]] = None
) -> Optional[LeaseHolder]:
    """The current holder record (the highest-numbered lease file), or ``None`` if none yet;
    :class:`LeaseUnreadableError` naming that file when it cannot be read."""
    return _current(prefix_uri, _generations(prefix_uri, storage_options), storage_options)


def lease_is_live(holder: Optional[LeaseHolder], now: Optional[float] = None) -> bool:
    """Whether ``holder`` still holds: not released, heartbeat within ``ttl_s``, and (same host)
    its process running with the recorded create time."""
    if holder is None or holder.released:
        return False
    now = time.time() if now is None else now
    if now - holder.heartbeat_at > holder.ttl_s:
        return False
    if holder.is_local():
        created = _create_time(holder.pid)
        if created is None or abs(created - holder.pid_create_time) > _CREATE_TIME_TOLERANCE_S:
            return False
    return True


class RunLease:
    """One writer per run: ``with RunLease(prefix) as holder: ...`` or acquire/release by hand.

    ``prefix_uri``: a directory (local path, ``file://``, ``s3://``) for the lease files only,
    e.g. ``<run>/lease``. ``ttl_s``: a heartbeat older than this is a dead holder;
    ``heartbeat_s``: the heartbeat period (well below ``ttl_s``); ``on_lost(new_holder)`` is
    called from the heartbeat thread once this lease is found taken over.
    """

    def __init__(
        self,
        prefix_uri: str,
        *,
        storage_options: Optional[Mapping[str, Any]] = None,
        ttl_s: float = 60.0,
        heartbeat_s: float = 10.0,
        flow_run_id: Optional[str] = None,
        on_lost: Optional[Callable[[Optional[LeaseHolder]], None]] = None,
    ) -> None:
        if not 0 < heartbeat_s < ttl_s:
            raise ValueError(f"need 0 < heartbeat_s < ttl_s, got heartbeat_s={heartbeat_s} ttl_s={ttl_s}")
        self.prefix_uri = os.fspath(prefix_uri)
        self.storage_options = storage_options
        self.ttl_s = float(ttl_s)
        self.heartbeat_s = float(heartbeat_s)
        self.flow_run_id = flow_run_id
        self.on_lost = on_lost
        self._holder: Optional[LeaseHolder] = None
        #: the holder this process took the lease from (its last heartbeat: when it was last seen alive)
        self.taken_from: Optional[LeaseHolder] = None
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------- state
    @property
    def holder(self) -> Optional[LeaseHolder]:
        """This process's holder record while it holds (or held) the lease."""
        return self._holder

    @property
    def lost(self) -> bool:
        """True once a higher-numbered lease was found: another writer took over."""
        return self._lost.is_set()

    def ensure_held(self) -> None:
        """Raise ``LeaseLostError`` unless this process holds the lease as far as it knows.

        Checks the lease files now (one listing), not only the heartbeat's last look.
        """
        if self._holder is None:
            raise LeaseLostError(f"the run lease at {self.prefix_uri} is not held by this process")
        if not self.lost and self._fenced():
            self._mark_lost()
        if self.lost:
            try:
                current = read_lease(self.prefix_uri, self.storage_options)
            except LeaseUnreadableError:
                current = None
            by = f" by {current.describe()}" if current else ""
            raise LeaseLostError(
                f"the run lease at {self.prefix_uri} (generation {self._holder.generation}) was taken over{by}"
            )

    # ----------------------------------------------------------------------- acquire
    def _path(self, generation: int) -> str:
        return sfs.join(self.prefix_uri, lease_name(generation))

    def acquire(self, *, take_over: bool = False) -> LeaseHolder:
        """Become the holder; ``LeaseHeldError`` naming a live holder (unless ``take_over``).

        A dead holder (released, stale heartbeat, or a gone local process) is taken over
        automatically. ``take_over=True`` takes the lease even from a live-looking holder: an
        operator's decision (e.g. its host is known dead); the old holder is fenced. The same
        decision passes an unreadable current lease file (:class:`LeaseUnreadableError`
        without it).
        """
        if self._holder is not None and not self.lost:
            return self._holder
        for _attempt in range(20):
            generations = _generations(self.prefix_uri, self.storage_options)
            try:
                current = _current(self.prefix_uri, generations, self.storage_options)
            except LeaseUnreadableError as exc:
                if not take_over:
                    raise
                log.warning("run lease %s: taking over from an unreadable lease file (%s)", self.prefix_uri, exc)
                current = None
            top = max(generations, default=0)
            if current is not None and current.generation == top and lease_is_live(current) and not take_over:
                raise LeaseHeldError(self.prefix_uri, current)
            now = time.time()
            me = os.getpid()
            holder = LeaseHolder(
                generation=top + 1,
                host=socket.gethostname(),
                pid=me,
                pid_create_time=_create_time(me) or 0.0,
                pid_namespace=_pid_namespace(),
                flow_run_id=self.flow_run_id,
                acquired_at=now,
                heartbeat_at=now,
                ttl_s=self.ttl_s,
                token=uuid.uuid4().hex,
            )
            if sfs.create_only(self._path(holder.generation), holder.to_json(), self.storage_options):
                if current is not None:  # a released lease is the normal hand-over; a dead holder is news
                    log.log(logging.INFO if current.released else logging.WARNING,
                            "run lease %s: took over from %s", self.prefix_uri, current.describe(now))
                self._holder = holder
                self.taken_from = current
                self._lost.clear()
                self._prune(holder.generation)
                return holder
            take_over = False  # another contender won this round: it is live, refuse it next
        raise RuntimeError(f"could not acquire the run lease at {self.prefix_uri}: too much contention")

    def _prune(self, generation: int) -> None:
        for old in _generations(self.prefix_uri, self.storage_options):
            if old <= generation - KEEP_FILES:
                try:
                    sfs.remove(self._path(old), storage_options=self.storage_options)
                except OSError as exc:  # best effort: old files are harmless
                    log.debug("run lease %s: could not prune %s: %s", self.prefix_uri, old, exc)

    # ----------------------------------------------------------------------- heartbeat
    def _fenced(self) -> bool:
        assert self._holder is not None
        return max(_generations(self.prefix_uri, self.storage_options), default=0) > self._holder.generation

    def _mark_lost(self) -> None:
        if self._lost.is_set():
            return
        self._lost.set()
        try:
            current = read_lease(self.prefix_uri, self.storage_options)
        except (OSError, ValueError):
            current = None
        log.error(
            "run lease %s: generation %s was taken over by %s; this process must stop writing",
            self.prefix_uri, self._holder.generation if self._holder else "?",
            current.describe() if current else "another writer",
        )
        if self.on_lost is not None:
            self.on_lost(current)

    def heartbeat(self) -> bool:
        """One heartbeat: ``False`` (and ``lost``) if fenced, else rewrite our file; ``True``."""
        with self._lock:
            if self._holder is None or self.lost:
                return False
            if self._fenced():
                self._mark_lost()
                return False
            self._holder = replace(self._holder, heartbeat_at=time.time())
            # durable (fsync): a heartbeat a power loss cuts leaves the old record, never an empty file
            sfs.write_bytes_atomic(self._path(self._holder.generation), self._holder.to_json(), self.storage_options)
            return True

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if not self.heartbeat():
                    return
            except Exception as exc:  # noqa: BLE001 - storage down: retry next period
                log.warning("run lease %s: heartbeat failed: %s", self.prefix_uri, exc)

    def start_heartbeat(self) -> None:
        """Heartbeat every ``heartbeat_s`` from a daemon thread (until stopped, released or lost)."""
        if self._holder is None:
            raise RuntimeError("acquire the lease before starting its heartbeat")
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"run-lease-{self._holder.generation}", daemon=True)
        self._thread.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self.heartbeat_s))
            self._thread = None

    # ----------------------------------------------------------------------- release
    def release(self) -> None:
        """Stop the heartbeat and mark our own file released; deletes nothing.

        After a takeover this only stops the heartbeat: the files of the new holder are
        never touched (ours is rewritten, which no reader uses once a higher one exists).
        """
        self.stop_heartbeat()
        with self._lock:
            if self._holder is None:
                return
            holder, self._holder = self._holder, None
            if self.lost:
                return
            try:
                if max(_generations(self.prefix_uri, self.storage_options), default=0) > holder.generation:
                    return
                released = replace(holder, released=True, heartbeat_at=time.time())
                sfs.write_bytes_atomic(self._path(holder.generation), released.to_json(), self.storage_options)
            except OSError as exc:  # the heartbeat then goes stale: same outcome after ttl_s
                log.warning("run lease %s: release failed (%s); it expires after %g s", self.prefix_uri, exc, holder.ttl_s)

    def __enter__(self) -> LeaseHolder:
        holder = self.acquire()
        self.start_heartbeat()
        return holder

    def __exit__(self, *exc: Any) -> None:
        self.release()
