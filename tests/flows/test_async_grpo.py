"""Async GRPO through the real flow (tiny config, 3 steps, age 1): every step's rollouts come from
exactly its scheduled weights version, the metrics line records the trajectory age, and in the
Prefect API the generation of step N+1 runs while step N trains (the overlap, from the task runs'
start and end times). The same async run twice ends with the same weights."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from tests.flows.conftest import kill_run_actors, tiny_run_config

ASYNC = {"grpo.async_grpo.enabled": True, "loss_fn.use_importance_sampling_correction": True}


def _task_runs(run_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    async def read():
        async with get_client() as c:
            return await c.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=f"-{run_id}-")), limit=200)

    return asyncio.run(read())


def _run(tmp_path, tiny_model_dir, ray_session, run_id: str) -> str:
    from flows.grpo import grpo

    root = str(tmp_path / "runs")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **ASYNC)
    try:
        grpo(config=cfg, run_id=run_id)
    finally:
        kill_run_actors(run_id)
    return root


def test_async_run_follows_the_schedule_and_overlaps(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    import storage
    from flows.metrics import read_metrics
    from nrl_tasks.stages.schedule import StepSchedule

    root = _run(tmp_path, tiny_model_dir, ray_session, "async-a")
    sched = StepSchedule(3, 1)
    for step in (1, 2, 3):
        m = storage.read_manifest(os.path.join(root, "async-a", "steps", f"step_{step:06d}", "rollouts"))
        assert m.meta["weights_version"] == sched.generation_version(step), (step, m.meta)
    rows = read_metrics(os.path.join(root, "async-a", "metrics.jsonl"))
    assert [r["trajectory_age"] for r in rows] == [0, 1, 1]
    runs = {tr.name: tr for tr in _task_runs("async-a")}
    gen2, train1 = runs["generate-async-a-step2"], runs["train-async-a-step1"]
    # step 2 generates while step 1 is on the policy workers (sync: only after train 1 and its refit)
    assert gen2.start_time < train1.end_time, (gen2, train1)
    with open(os.path.join(root, "async-a", "status.json"), encoding="utf-8") as fh:
        assert json.load(fh)["status"] == "completed"


def test_async_run_is_deterministic(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    from tests.faults.helpers import train_checksum

    a = _run(tmp_path / "a", tiny_model_dir, ray_session, "async-b1")
    b = _run(tmp_path / "b", tiny_model_dir, ray_session, "async-b2")
    assert [train_checksum(a, "async-b1", s) for s in (1, 2, 3)] == [train_checksum(b, "async-b2", s) for s in (1, 2, 3)]


def test_resuming_an_async_run_is_refused_until_implemented(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    from flows.grpo import grpo

    root = _run(tmp_path, tiny_model_dir, ray_session, "async-c")
    with pytest.raises(ValueError, match="resuming an async GRPO run is not implemented"):
        grpo(config=None, run_id="async-c", resume=True, storage=root, overrides=["grpo.max_num_steps=4"])
    kill_run_actors("async-c")
