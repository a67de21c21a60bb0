"""Names and tags of Prefect flow runs, set after they started (cosmetic: never raises).

A run's flow run and its step subflows carry ``run:<run_id>``; an eval flow run carries one such
tag per run it evaluated. The run's own flow runs (not the subflows) also carry ``flow:<run_id>``. Tags are added to what the flow run has (a deployment's ``nrl``,
``train``), never replacing it. Task runs carry no tags (see :func:`flows.algorithms.step.tag_flow_run`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

__all__ = ["add_flow_run_tags", "flow_run_name", "flow_tag", "refused_name", "rename_flow_run", "run_tag"]

logger = logging.getLogger(__name__)


def run_tag(run_id: str) -> str:
    """Every flow run of run ``run_id``: its own, its step subflows, the eval sweeps that read it."""
    return f"run:{run_id}"


def flow_tag(run_id: str) -> str:
    """Only the run's own flow runs (its start, resumes, extensions, retries, refusals): the one
    filter that finds them in the UI's Runs list (Tags: ``flow:<run_id>``), without the subflows."""
    return f"flow:{run_id}"


def flow_run_name(run_id: str, what: str, attempt: int) -> str:
    """``<run_id>`` for the run's first flow, ``<run_id>-<what>-<attempt>`` for the others (``what``:
    :func:`flows.run.history.attempt_kind`)."""
    return run_id if what == "start" else f"{run_id}-{what}-{attempt}"


def refused_name(run_id: str, flow_run_id: str | None = None) -> str:
    """``<run_id>-refused-<first 6 hex digits of the flow run id>``: unique per refused flow run."""
    tag = (flow_run_id or "").replace("-", "")[:6]
    return f"{run_id}-refused-{tag}" if tag else f"{run_id}-refused"


def add_flow_run_tags(flow_run_id: str | None, tags: Sequence[str], *, max_run_tags: int | None = None) -> list[str]:
    """Add ``tags`` to a flow run's tags (at most ``max_run_tags`` ``run:`` tags in all); the tags
    added. Failures are logged at DEBUG level and return ``[]``."""
    if not flow_run_id or not tags:
        return []
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            fid = uuid.UUID(str(flow_run_id))
            have = list(client.read_flow_run(fid).tags)
            new = [t for t in dict.fromkeys(tags) if t not in have]
            if max_run_tags is not None:
                room = max(0, max_run_tags - sum(t.startswith("run:") for t in have))
                runs = [t for t in new if t.startswith("run:")][:room]
                new = [t for t in new if not t.startswith("run:") or t in runs]
            if new:
                client.update_flow_run(flow_run_id=fid, tags=have + new)
            return new
    except Exception as exc:  # noqa: BLE001 - cosmetic
        logger.debug("tagging flow run %s failed: %s", flow_run_id, exc)
        return []


def rename_flow_run(flow_run_id: str | None, name: str) -> None:
    """Rename a flow run (a finished GRPO run's flow run becomes its run id)."""
    if not flow_run_id:
        return
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run_id=uuid.UUID(str(flow_run_id)), name=name)
    except Exception as exc:  # noqa: BLE001 - cosmetic
        logger.debug("renaming flow run %s failed: %s", flow_run_id, exc)
