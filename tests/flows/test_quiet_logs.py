"""The lifecycle filter drops completed-run lines at INFO only, and only while it is installed."""

from __future__ import annotations

import logging

import pytest

from flows.observe.quiet_logs import quiet_lifecycle_logs


def _emit(caplog, level: int, msg: str, name: str = "prefect.task_runs") -> bool:
    caplog.clear()
    logging.getLogger(name).log(level, msg)
    return any(r.getMessage() == msg for r in caplog.records)


def test_completed_lines_are_dropped_failures_and_others_kept(caplog):
    caplog.set_level(logging.DEBUG)
    for name in ("prefect.task_runs", "prefect.flow_runs"):  # Prefect's logging config may have raised them
        caplog.set_level(logging.DEBUG, logger=name)
    with quiet_lifecycle_logs("INFO"):
        assert not _emit(caplog, logging.INFO, "Finished in state Completed()")
        assert not _emit(caplog, logging.INFO, "Finished in state Completed()", "prefect.flow_runs")
        assert _emit(caplog, logging.ERROR, "Finished in state Failed('boom')")
        assert _emit(caplog, logging.INFO, "Finished in state Failed('boom')", "prefect.flow_runs")
        assert _emit(caplog, logging.INFO, "[r] step 1/3 reward 0.5")
        assert _emit(caplog, logging.WARNING, "step 1 reward: NaN")
    assert _emit(caplog, logging.INFO, "Finished in state Completed()")  # removed after the block
    with quiet_lifecycle_logs("DEBUG"):
        assert _emit(caplog, logging.INFO, "Finished in state Completed()")


def _flow_logs(api_url: str, run_id: str) -> list:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def query():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=run_id)))
            flt, out = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in runs])), []
            while True:  # the API pages logs 200 at a time
                page = await client.read_logs(log_filter=flt, limit=200, offset=len(out))
                out += page
                if len(page) < 200:
                    return out

    with temporary_settings({PREFECT_API_URL: api_url}):
        return asyncio.run(query())


@pytest.mark.slow  # a whole flow run (+ resume): keeps make test under 15 minutes
def test_a_run_logs_one_info_line_per_step(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    """A real 2-step run at INFO (the test session logs at WARNING): no completed-run lines, one
    step line a step; with ``logger.log_level=DEBUG`` Prefect's lines are back."""
    import yaml

    from tests.faults.helpers import run_nrl
    from tests.fixtures.grpo_runs import kill_run_actors, tiny_run_config

    counts = {}
    for level in ("INFO", "DEBUG"):
        run_id = f"quiet-{level.lower()}"
        cfg = tiny_run_config(tiny_model_dir, str(tmp_path / "runs"), ray_session, **{
            "grpo.max_num_steps": 2, "checkpointing.enabled": False, "logger.log_level": level})
        path = tmp_path / f"{run_id}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        try:
            p = run_nrl(["grpo", "--config", str(path), "--run-id", run_id], prefect_harness,
                        env_extra={"PREFECT_LOGGING_LEVEL": "INFO"})
            assert p.returncode == 0, p.stderr[-3000:]
        finally:
            kill_run_actors(run_id)
        info = [entry.message for entry in _flow_logs(prefect_harness, run_id) if entry.level == logging.INFO]
        counts[level] = sum(m.startswith("Finished in state Completed") for m in info)
        steps = sorted(m.split()[2] for m in info if m.startswith(f"[{run_id}] step "))
        assert steps == ["1/2", "2/2"], info[:20]
    # INFO: at most the run's own flow run reports its end (after the filter is removed)
    assert counts["INFO"] <= 1 and counts["DEBUG"] >= 10, counts
