"""Checkpoint holds: a reader marks the checkpoint it reads so that retention leaves it alone.

A hold is one small JSON file per holder under the run (local disk or S3, through
:mod:`storage.fs`)::

    <run>/holds/step_000004.hold.<holder>.json       a reader (shared: any number of them)
    <run>/holds/step_000004.claim.<key>.json         an evaluation of the checkpoint on the
                                                     dataset ``key`` (exclusive: created only if
                                                     absent, so two sweeps never both run it)
    <run>/holds/step_000004.deleting.json            retention is deleting the checkpoint

Each file records ``host``, ``pid`` and ``expires_unix``; a background thread of the holder
pushes the expiry forward every ``ttl_s / 3``. A record is dead once expired, or when it was
written on this host by a process that is gone; dead records are ignored and cleaned.

Holds and claims both keep a checkpoint. Retention and readers order their writes the same way
(write your own record first, then look for the other side's), so at least one of them sees the
other:

- retention: write ``deleting``, then look for holds/claims; held: withdraw, keep it for a
  later pass; not held: delete (``checkpoint.json`` first), then remove ``deleting``;
- reader: write its hold/claim, then check that no ``deleting`` is live and that
  ``checkpoint.json`` still exists; otherwise release and skip the checkpoint.
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
from dataclasses import dataclass
from typing import Any

from nrl_tasks.run_layout import RunLayout, join_uri
from storage import fs

__all__ = [
    "DEFAULT_TTL_S",
    "Hold",
    "HoldRecord",
    "claim_checkpoint",
    "hold_checkpoint",
    "holds_uri",
    "is_deleting",
    "is_held",
    "list_holds",
    "mark_deleting",
]

logger = logging.getLogger(__name__)

#: Seconds a record stays live without a heartbeat (the holder refreshes it every third of it).
DEFAULT_TTL_S = 300.0

HOLD, CLAIM, DELETING = "hold", "claim", "deleting"
_KINDS = (HOLD, CLAIM, DELETING)
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def holds_uri(layout: RunLayout) -> str:
    return join_uri(layout.run_uri, "holds")


def _fs():
    return fs


def _file_name(checkpoint: str, kind: str, tag: str | None) -> str:
    return f"{checkpoint}.{kind}.{tag}.json" if tag else f"{checkpoint}.{kind}.json"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@dataclass(frozen=True)
class HoldRecord:
    """One hold file as read back."""

    uri: str
    checkpoint: str
    kind: str
    holder: str
    host: str
    pid: int
    expires_unix: float

    def alive(self, now: float | None = None) -> bool:
        if (now if now is not None else time.time()) > self.expires_unix:
            return False
        return self.host != socket.gethostname() or _pid_alive(self.pid)


def _read_record(uri: str, opts: dict[str, Any] | None) -> HoldRecord | None:
    try:
        d = json.loads(_fs().read_text(uri, storage_options=opts))
        return HoldRecord(
            uri=uri, checkpoint=str(d["checkpoint"]), kind=str(d["kind"]), holder=str(d["holder"]),
            host=str(d["host"]), pid=int(d["pid"]), expires_unix=float(d["expires_unix"]),
        )
    except FileNotFoundError:
        return None  # released meanwhile
    except (ValueError, KeyError, TypeError):
        # unreadable (not ours or truncated by hand): treat as expired so that it gets cleaned
        return HoldRecord(uri, uri.rsplit("/", 1)[-1].split(".", 1)[0], "unknown", "?", "?", 0, 0.0)


def list_holds(
    layout: RunLayout, checkpoint: str | None = None, storage_options: dict[str, Any] | None = None,
    *, clean: bool = True,
) -> list[HoldRecord]:
    """The live records (of ``checkpoint``, or all); dead ones are removed when ``clean``."""
    fs = _fs()
    base = holds_uri(layout)
    out = []
    now = time.time()
    for name in fs.list_dir(base, storage_options=storage_options):
        if not name.endswith(".json") or (checkpoint is not None and not name.startswith(f"{checkpoint}.")):
            continue
        rec = _read_record(join_uri(base, name), storage_options)
        if rec is None:
            continue
        if rec.alive(now):
            out.append(rec)
        elif clean:
            _remove_if_unchanged(rec, storage_options)
    return out


def _remove_if_unchanged(rec: HoldRecord, opts: dict[str, Any] | None) -> None:
    """Clean a dead record unless its holder refreshed or another took it since it was read."""
    again = _read_record(rec.uri, opts)
    if again is None or again.alive() or (again.holder, again.expires_unix) != (rec.holder, rec.expires_unix):
        return
    logger.info("holds: removing the dead %s of %s by %s (pid %s on %s)", rec.kind, rec.checkpoint, rec.holder, rec.pid, rec.host)
    _fs().remove(rec.uri, storage_options=opts)


def is_held(
    layout: RunLayout, checkpoint: str, storage_options: dict[str, Any] | None = None, *, ignore: str | None = None
) -> bool:
    """Whether a live reader hold or evaluation claim keeps ``checkpoint`` (``ignore``: a holder id)."""
    return any(r.kind in (HOLD, CLAIM) and r.holder != ignore for r in list_holds(layout, checkpoint, storage_options))


def is_deleting(layout: RunLayout, checkpoint: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether retention (alive) is deleting ``checkpoint``."""
    return any(r.kind == DELETING for r in list_holds(layout, checkpoint, storage_options))


def _create_only(uri: str, data: bytes, opts: dict[str, Any] | None) -> bool:
    """Write ``uri`` only if it does not exist yet (atomically); ``False`` if it does."""
    fs = _fs()
    if hasattr(fs, "create_only"):  # the storage layer's exclusive create (also maps SeaweedFS's 412)
        return bool(fs.create_only(uri, data, opts))
    handle, path = fs.resolve(uri, opts)
    if fs.is_local(uri):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = fs.local_temp_path(path)
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.link(tmp, path)  # atomic, and fails if the name exists
        except FileExistsError:
            return False
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        fs.fsync_dir(os.path.dirname(path))
        return True
    try:
        handle.pipe_file(path, data, mode="create")  # If-None-Match: *
    except FileExistsError:
        return False
    except (TypeError, NotImplementedError):  # a filesystem without exclusive writes: check, then put
        if fs.exists(uri, storage_options=opts):
            return False
        fs.write_bytes_atomic(uri, data, opts)  # the caller reads it back to see who won
    finally:
        fs.invalidate_cache(handle, path)
    return True


class Hold:
    """A live record of this process (a hold, claim or deletion mark); refreshed until released.

    Use as a context manager, or call :meth:`release`.
    """

    def __init__(
        self, layout: RunLayout, checkpoint: str, kind: str, uri: str, holder: str,
        storage_options: dict[str, Any] | None, ttl_s: float,
    ) -> None:
        self.layout, self.checkpoint, self.kind, self.uri, self.holder = layout, checkpoint, kind, uri, holder
        self.storage_options, self.ttl_s = storage_options, ttl_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def body(self) -> bytes:
        now = time.time()
        return json.dumps(
            {
                "checkpoint": self.checkpoint, "kind": self.kind, "holder": self.holder,
                "host": socket.gethostname(), "pid": os.getpid(),
                "heartbeat_unix": now, "expires_unix": now + self.ttl_s,
            },
            sort_keys=True,
        ).encode()

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name=f"nrl-hold-{self.checkpoint}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                _fs().write_bytes_atomic(self.uri, self.body(), self.storage_options, fsync=False)
            except Exception as exc:  # noqa: BLE001 - keep beating; the next one may get through
                logger.warning("holds: heartbeat of %s failed: %s", self.uri, exc)

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        _fs().remove(self.uri, storage_options=self.storage_options)

    def __enter__(self) -> "Hold":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _holder_id() -> str:
    return _UNSAFE.sub("-", f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _take(
    layout: RunLayout, checkpoint: str, kind: str, tag: str | None, *, exclusive: bool,
    storage_options: dict[str, Any] | None, ttl_s: float,
) -> Hold | None:
    if kind not in _KINDS:
        raise ValueError(f"holds: unknown kind {kind!r}")
    holder = _holder_id()
    uri = join_uri(holds_uri(layout), _file_name(checkpoint, kind, tag if exclusive or tag else holder))
    hold = Hold(layout, checkpoint, kind, uri, holder, storage_options, ttl_s)
    if not exclusive:
        _fs().write_bytes_atomic(uri, hold.body(), storage_options)
    else:
        for _ in range(2):
            if _create_only(uri, hold.body(), storage_options):
                break
            other = _read_record(uri, storage_options)
            if other is not None and other.alive():
                return None
            if other is not None:
                _remove_if_unchanged(other, storage_options)  # a dead holder's: take it over
        else:
            return None
        mine = _read_record(uri, storage_options)  # stores without If-None-Match just overwrite
        if mine is None or mine.holder != holder:
            return None
    hold._start_heartbeat()
    return hold


def hold_checkpoint(
    layout: RunLayout, checkpoint: str, storage_options: dict[str, Any] | None = None, *, ttl_s: float = DEFAULT_TTL_S
) -> Hold:
    """A shared reader hold on ``checkpoint``; then check the checkpoint is still committed."""
    hold = _take(layout, checkpoint, HOLD, None, exclusive=False, storage_options=storage_options, ttl_s=ttl_s)
    assert hold is not None
    return hold


def claim_checkpoint(
    layout: RunLayout, checkpoint: str, key: str, storage_options: dict[str, Any] | None = None,
    *, ttl_s: float = DEFAULT_TTL_S,
) -> Hold | None:
    """The exclusive claim to evaluate ``checkpoint`` on dataset ``key`` (it holds the checkpoint
    too); ``None`` when a live holder has it."""
    return _take(layout, checkpoint, CLAIM, key, exclusive=True, storage_options=storage_options, ttl_s=ttl_s)


def mark_deleting(
    layout: RunLayout, checkpoint: str, storage_options: dict[str, Any] | None = None, *, ttl_s: float = DEFAULT_TTL_S
) -> Hold | None:
    """Retention's mark before it deletes ``checkpoint``; ``None`` when another deleter has it."""
    return _take(layout, checkpoint, DELETING, None, exclusive=True, storage_options=storage_options, ttl_s=ttl_s)
