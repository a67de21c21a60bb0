"""Crash bookkeeping: the task runs a killed flow left Running are marked Crashed on resume.

A flow process that is SIGKILLed (an OOM kill, a lost machine) cannot report the end of the task
run it was in, so Prefect shows that task run Running forever, inside a flow run that the server
itself later marks Crashed, even after a retry or a resume finished the run. The next flow of
the run (``nrl resume``, a deployment run with ``resume=true``, or ``prefect flow-run retry`` of
the same flow run) holds the run's lease, so nothing else can still be running those task runs:
before it starts any work it sets every task run of the previous flow run and of its step
subflows that is still Running or Pending to Crashed, those subflow runs too, and the previous
flow run itself when it is not the current one (``prefect flow-run retry`` reuses it), with what
the current flow does about it in the state message (restored checkpoint, replayed steps). Best effort: a failure to reach the API is a warning, not an error.
"""

from __future__ import annotations

import uuid
from typing import Any

__all__ = ["mark_orphans_crashed"]


def mark_orphans_crashed(
    previous_flow_run_id: str | None, current_flow_run_id: str | None, log: Any, account: str = "",
) -> int:
    """Mark the unfinished task runs and step subflows of ``previous_flow_run_id`` Crashed, and that
    flow run itself unless it is the current one (see the module docstring); ``account``: what the
    current flow does about it, added to the previous flow run's state message. Returns how many
    runs were marked."""
    if not previous_flow_run_id:
        return 0
    try:
        current = uuid.UUID(current_flow_run_id) if current_flow_run_id else None
        return _mark(uuid.UUID(previous_flow_run_id), current, log, account)
    except Exception as exc:  # noqa: BLE001 - bookkeeping must not stop a resume
        log.warning("could not mark the previous flow run's unfinished task runs Crashed: %s", exc)
        return 0


def _mark(previous: uuid.UUID, current: uuid.UUID | None, log: Any, account: str) -> int:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterParentFlowRunId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    unfinished = [StateType.RUNNING, StateType.PENDING]
    msg = "its flow process ended without reporting it (killed); marked by the run's next flow"
    marked = 0
    with get_client(sync_client=True) as client:
        subflows = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[previous])), limit=200,
        )
        ids = [previous, *(r.id for r in subflows)]
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=unfinished))),
            limit=200,
        )
        for t in tasks:
            client.set_task_run_state(t.id, Crashed(message=msg), force=True)
            marked += 1
        for r in subflows:
            if r.id != current and r.state is not None and r.state.type in unfinished:
                client.set_flow_run_state(r.id, Crashed(message=msg), force=True)
                marked += 1
        if previous != current:  # ``nrl resume`` / a deployment run: a new flow run; the killed one stays Running
            run = client.read_flow_run(previous)
            if run.state is not None and run.state.type in unfinished:
                note = f"{msg}; {account}" if account else msg
                client.set_flow_run_state(previous, Crashed(message=note[:2000]), force=True)
                marked += 1
    if marked:
        log.warning("marked %d task/subflow run(s) of the previous flow run %s Crashed (left Running when it was killed)",
                    marked, previous)
    return marked
