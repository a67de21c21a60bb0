"""A run's history: every flow that ran it, in ``status.json`` (``history``), and its flow runs' names.

Each flow of a run that gets past the session's checks appends one entry when it starts
(:func:`begin_attempt`) and closes it when it ends (:func:`end_attempt`)::

    {"attempt": 3, "kind": "extend", "flow_run_id": "...", "started_unix": ..., "max_steps": 12,
     "trained": 8, "restore_from": 8, "replay": [], "ended_unix": ..., "outcome": "completed"}

``kind`` (:func:`attempt_kind`): ``start`` (the run's first flow), ``retry`` (the same Prefect flow
run again: the UI's Retry, ``prefect flow-run retry``), ``extend`` (a resume with a larger step
budget) or ``resume``; ``trained`` the steps committed before it, ``restore_from`` the checkpoint
step its recovery restores (0: the initial weights; absent: it kept or needed no policy) and
``replay`` the steps replayed on it. ``outcome``: ``completed``, ``failed``, ``interrupted``
(SIGINT, SIGTERM), or, written by the next flow for an entry left open, ``crashed`` (its flow
process is gone: SIGKILL, OOM, a lost machine) or ``taken over`` (``--take-over``). The list
keeps the last :data:`MAX_ENTRIES`.

A flow run is named after what it does (:func:`flow_run_name`): the run id for its start,
``<run_id>-<kind>-<attempt>`` otherwise (``grpo-1a2b-extend-3``), and ``<run_id>-refused-<6 hex>`` when the
session refused it (a second writer, an existing run id, a changed config); the run summary
shows the history (:func:`flows.observe.summary.history_markdown`).

>>> flow_run_name("r1", "start", 1), flow_run_name("r1", "retry", 2), flow_run_name("r1", "extend", 3)
('r1', 'r1-retry-2', 'r1-extend-3')
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from flows.observe.flow_run_meta import flow_run_name, refused_name

__all__ = ["MAX_ENTRIES", "attempt_kind", "begin_attempt", "end_attempt", "flow_run_name", "refused_name"]

#: entries kept in ``status.json`` (the oldest are dropped; ``attempt`` keeps counting)
MAX_ENTRIES = 100


def attempt_kind(previous: Mapping[str, Any], flow_run_id: str | None, *, max_steps: int) -> str:
    """What this flow does to the run ``previous`` (its ``status.json``; ``{}``: a new run) describes."""
    if not previous.get("status"):
        return "start"
    if flow_run_id and previous.get("flow_run_id") == flow_run_id:
        return "retry"
    before = previous.get("max_steps")
    return "extend" if isinstance(before, int) and max_steps > before else "resume"


def begin_attempt(
    previous: Mapping[str, Any], *, kind: str, flow_run_id: str | None, max_steps: int, previous_outcome: str | None = None,
    previous_last_seen: float | None = None,
    trained: int | None = None, restore_from: int | None = None, replay: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """The history with this flow's entry appended (see the module docstring); the previous
    flow's entry, when left open, is closed with ``previous_outcome`` (``crashed``: its process
    is gone; ``taken over``) when one is given, and ``previous_last_seen`` (its lease's last
    heartbeat: it ended after that, unseen)."""
    history = [dict(e) for e in previous.get("history") or []]
    if history and previous_outcome and "outcome" not in history[-1]:
        history[-1].update(outcome=previous_outcome, ended_unix=None, last_seen_unix=previous_last_seen)
    attempt = int(history[-1].get("attempt", len(history))) + 1 if history else 1
    entry: dict[str, Any] = {"attempt": attempt, "kind": kind, "flow_run_id": flow_run_id,
                             "started_unix": round(time.time(), 3), "max_steps": max_steps}
    if trained is not None:
        entry["trained"] = trained
    if restore_from is not None:
        entry["restore_from"] = restore_from
    if replay:
        entry["replay"] = list(replay)
    return (history + [entry])[-MAX_ENTRIES:]


def end_attempt(history: list[dict[str, Any]], outcome: str, error: str | None = None) -> list[dict[str, Any]]:
    """The history with its last entry closed: ``outcome`` and the time, ``error`` (first line, cut)."""
    out = [dict(e) for e in history]
    if out:
        out[-1].update(outcome=outcome, ended_unix=round(time.time(), 3))
        if error:
            lines = error.strip().splitlines()
            out[-1]["error"] = (lines[0] if lines else error)[:200]
    return out
