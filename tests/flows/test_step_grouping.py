"""A long run shows runs, not steps (issue 29, item 3): at the default settings a 40-step run's
steps run in 4 subflows of 10 steps, a fault re-runs the rest of its subflow as ``-retry1``, and
the run leaves at most 12 flow runs and 15 artifact versions on a real Prefect server; the step
lines stay in the run's own flow-run log."""

from __future__ import annotations

import logging
import os

import pytest

from tests.fixtures.grpo_runs import tiny_run_config

RUN_ID = "grouped40"


def _server_view(run_id: str) -> tuple[list, list, list]:
    """(flow runs tagged ``run:<id>`` and their subflows, artifacts of those flow runs, logs of the run's flow run)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterParentFlowRunId, FlowRunFilterTags, LogFilter,
        LogFilterFlowRunId,
    )

    with get_client(sync_client=True) as client:
        parents = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{run_id}"])), limit=200)
        top = [r for r in parents if r.parent_task_run_id is None]
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[r.id for r in top])), limit=200)
        runs = {r.id: r for r in [*parents, *children]}
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=list(runs))), limit=200)
        logs: list = []
        while True:  # the API pages logs by 200
            page = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in top])),
                                    limit=200, offset=len(logs))
            logs += page
            if len(page) < 200:
                break
    return list(runs.values()), arts, logs


@pytest.mark.slow  # a 40-step run with an injected fault: in the slow suite (keeps make test under 10 minutes)
def test_forty_steps_leave_few_flow_runs_and_artifacts(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    from flows.algorithms.grpo import grpo
    from flows.observe.metrics import read_metrics
    from nrl_tasks.run_layout import RunLayout

    root = str(tmp_path / "runs")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{
        "grpo.max_num_steps": 40, "checkpointing.save_period": 10, "policy.max_total_sequence_length": 32})
    os.environ["NRL_FAULT_REFIT_PARTIAL"] = "7"  # the refit of step 7 fails mid-stream once: its subflow fails
    run_logger = logging.getLogger("prefect.flow_runs")  # the tests' Prefect logs are at WARNING: the step lines are INFO
    level = run_logger.level
    run_logger.setLevel(logging.INFO)
    try:
        grpo(config=cfg, run_id=RUN_ID)
    finally:
        os.environ.pop("NRL_FAULT_REFIT_PARTIAL", None)
        run_logger.setLevel(level)
    assert [r["step"] for r in read_metrics(RunLayout(root, RUN_ID).metrics_uri)] == list(range(1, 41))

    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)  # the log lines still batched in this process
    runs, arts, logs = _server_view(RUN_ID)
    names = sorted(r.name for r in runs)
    segments = [f"{RUN_ID}-steps-{a:04d}-{b:04d}" for a, b in ((1, 10), (11, 20), (21, 30), (31, 40))]
    assert names == sorted([RUN_ID, *segments, f"{RUN_ID}-steps-0007-0010-retry1"]), names
    assert len(runs) <= 12
    by_name = {r.name: r for r in runs}
    assert by_name[f"{RUN_ID}-steps-0001-0010"].state.is_failed()
    assert all(r.state.is_completed() for n, r in by_name.items() if n != f"{RUN_ID}-steps-0001-0010")
    assert all(f"run:{RUN_ID}" in r.tags for r in runs), [(r.name, r.tags) for r in runs]

    # one artifact of each kind, updated in place, all on the run's flow run (not on its subflows)
    assert len(arts) <= 15, [(a.key, a.type) for a in arts]
    keys = sorted(a.key for a in arts if a.key)
    assert keys == sorted(f"nrl-{RUN_ID}-{k}" for k in ("metrics", "progress", "rollouts", "summary")), keys
    keyed = [a for a in arts if a.key]  # (a failed subflow's state also has a keyless result record, not in the tab)
    assert {a.flow_run_id for a in keyed} == {by_name[RUN_ID].id}, [(a.key, a.flow_run_id) for a in keyed]
    serializers = {a.data["serializer"]["type"] for a in arts if isinstance(a.data, dict) and "serializer" in a.data}
    assert "pickle" not in serializers, serializers  # no pickle persisted, also for a failed subflow's state
    summary = next(a for a in arts if a.key == f"nrl-{RUN_ID}-summary")
    assert "step 40 of 40" in summary.data

    step_lines = {m.message.split()[2] for m in logs if m.message.startswith(f"[{RUN_ID}] step ")}
    assert step_lines == {f"{s}/40" for s in range(1, 41)}, sorted(step_lines)
