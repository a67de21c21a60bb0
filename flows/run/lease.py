"""One writer per run: the flow holds the run's lease (:mod:`storage.lease`) for its whole life.

Why a lease in the run's storage and not Prefect's global concurrency limits: the one thing two
writers of a run always share is the run's storage. Two ``nrl resume`` without
``PREFECT_API_URL`` each start their own ephemeral Prefect API (each with its own database),
so a Prefect limit would not see the other; and a run on S3 may be resumed from another machine
against another Prefect server. The lease lives next to the data it protects, on local disk
and S3 alike.

- Acquired by the flow before it writes anything (``config.yaml``, ``status.json``); refused at
  once, with :class:`storage.lease.LeaseHeldError` naming the holder (host, pid, flow run), while
  another holder is live. A holder is dead when its heartbeat is older than the lease's TTL, or
  at once when it is on this machine and its process is gone (a SIGKILLed flow): then the next
  flow takes the lease over without being asked. ``nrl resume RUN --take-over`` takes a live-looking
  lease (a holder on a machine that died, before its TTL has run out).
- Heartbeats from a daemon thread; a holder whose lease was taken over is *fenced*: the flow
  stops before its next commit or step (``storage.lease.LeaseLostError``: every stage commit, checkpoint
  commit, metrics line and status write checks the lease first) and writes nothing more. Under the lease, the storage commit is
  create-only as well, so even a fenced writer cannot overwrite a committed dataset.
- An unreadable lease file (empty or garbled: a power loss) is named, never taken for a dead
  holder: ``nrl resume`` refuses with the file and the way on (``--take-over``, which takes the
  lease past it); ``nrl runs`` shows the run ``lease unreadable`` and lists the others.
- ``NRL_LEASE_TTL_S`` / ``NRL_LEASE_HEARTBEAT_S`` (:class:`nrl_tasks.settings.NrlSettings`) tune
  the timing.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from flows.run.hints import resume_command
from nrl_tasks.run_layout import RunLayout, join_uri
from nrl_tasks.settings import NrlSettings, nrl_settings
from nrl_tasks.stages.errors import exception_chain
from storage.lease import LeaseUnreadableError, RunLease, lease_is_live, read_lease

__all__ = [
    "LeaseSettings",
    "check_fence",
    "hold_run_lease",
    "lease_refusal",
    "lease_uri",
    "live_holder",
    "resume_refusal",
]


class LeaseSettings(BaseModel):
    """Timing of the run lease: the fields not given come from the environment
    (``NRL_LEASE_TTL_S``, ``NRL_LEASE_HEARTBEAT_S``: :class:`nrl_tasks.settings.NrlSettings`)."""

    ttl_s: float = Field(
        default_factory=lambda: nrl_settings().lease_ttl_s, gt=0, le=3600,
        description=NrlSettings.model_fields["lease_ttl_s"].description,
    )
    heartbeat_s: float = Field(
        default_factory=lambda: nrl_settings().lease_heartbeat_s, gt=0, le=600,
        description=NrlSettings.model_fields["lease_heartbeat_s"].description,
    )


def lease_uri(layout: RunLayout) -> str:
    """Where the run's lease files live: ``<run>/lease/``."""
    return join_uri(layout.run_uri, "lease")


def hold_run_lease(
    layout: RunLayout,
    storage_options: dict[str, Any] | None,
    flow_run_id: str | None,
    *,
    take_over: bool = False,
    settings: LeaseSettings | None = None,
) -> RunLease:
    """Acquire the run's lease and start its heartbeat; ``LeaseHeldError`` while another holder is live."""

    s = settings or LeaseSettings()
    lease = RunLease(
        lease_uri(layout), storage_options=storage_options, ttl_s=s.ttl_s, heartbeat_s=s.heartbeat_s,
        flow_run_id=flow_run_id,
    )
    lease.acquire(take_over=take_over)
    lease.start_heartbeat()
    return lease


def check_fence(lease: RunLease) -> None:
    """Raise ``storage.lease.LeaseLostError`` when ``lease`` has been taken over (between steps:
    one listing of the lease files)."""
    lease.ensure_held()


def live_holder(layout: RunLayout, storage_options: dict[str, Any] | None = None) -> Any:
    """The live holder of the run's lease (a ``LeaseHolder``), or ``None``;
    ``storage.lease.LeaseUnreadableError`` naming the current lease file when it cannot be read."""

    holder = read_lease(lease_uri(layout), storage_options=storage_options)
    return holder if holder is not None and lease_is_live(holder) else None


def _unreadable_advice(run_id: str) -> str:
    return (
        "whether another process writes the run cannot be told from it; if none does, take over with "
        f"{resume_command(run_id, '--take-over')}"
    )


def resume_refusal(layout: RunLayout, storage_options: dict[str, Any] | None = None) -> str | None:
    """Why ``nrl resume`` (without ``--take-over``) must not start the run, in one line: another
    live writer, or an unreadable lease file (named); ``None`` when the lease is free."""

    run_id = layout.run_id
    try:
        holder = live_holder(layout, storage_options)
    except LeaseUnreadableError as exc:
        return f"run {run_id}: lease file {exc.path} is unreadable ({exc.reason}); {_unreadable_advice(run_id)}"
    if holder is None:
        return None
    return (
        f"run {run_id} has a live writer ({holder.describe()}); wait for it to end, or, if that process is dead "
        f"on another machine, take over with {resume_command(run_id, '--take-over')}"
    )


def lease_refusal(exc: BaseException) -> str | None:
    """How to proceed when ``exc`` is (or wraps) a refused lease, or a lease taken over while this
    process held it (it must not resume the run); ``None`` for any other error."""
    from storage.lease import LeaseHeldError, LeaseLostError, LeaseUnreadableError

    for e in exception_chain(exc):
        if isinstance(e, LeaseLostError):
            return (
                "another process took the run over (nrl resume --take-over) and now writes it; this process "
                "stopped and wrote nothing more: do not resume it from here"
            )
        if isinstance(e, LeaseHeldError):
            return (
                f"the run has another writer ({e.holder.describe()}); nothing was written. Wait for it to end; "
                f"if that process is dead on another machine, its lease expires {LeaseSettings().ttl_s:.0f} s after "
                "its last heartbeat, or take over now with `nrl resume RUN_ID --take-over`"
            )
        if isinstance(e, LeaseUnreadableError):
            return f"the run's lease file is unreadable, nothing was written; {_unreadable_advice('RUN_ID')}"
    return None
