"""Async GRPO through the real flow (tiny config, 3 steps, age 1): every step's rollouts come from
exactly its scheduled weights version, the metrics line records the trajectory age, and in the
Prefect API the generation of step N+1 runs while step N trains (the overlap, from the task runs'
start and end times). A 3-step run extended to 4 steps ends with the weights of the uninterrupted
4-step run (``async_run``), which also shows two async runs agree."""

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
    from flows.algorithms.grpo import grpo

    root = str(tmp_path / "runs")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **ASYNC)
    try:
        grpo(config=cfg, run_id=run_id)
    finally:
        kill_run_actors(run_id)
    return root


def test_async_run_follows_the_schedule_and_overlaps(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    import storage
    from flows.observe.metrics import read_metrics
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


def test_extending_an_async_run_generates_the_missing_step_on_its_own_version(
    tmp_path, prefect_harness, ray_session, tiny_model_dir, async_run
):
    """A 3-step async run extended to 4 steps: step 4 generates on version 2 (the schedule), older
    than the policy's 3, so the resume restores checkpoint 2, generates step 4 on it, replays step 3
    and trains 4: the weights equal the uninterrupted 4-step run's, step for step."""
    import storage
    from flows.algorithms.grpo import grpo
    from tests.faults.helpers import train_checksum
    from tests.fixtures.grpo_runs import ASYNC_OVERRIDES, ASYNC_RUN_ID

    root = str(tmp_path / "runs")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{**ASYNC_OVERRIDES, "grpo.max_num_steps": 3})
    try:
        grpo(config=cfg, run_id="async-x")
        kill_run_actors("async-x")  # a lost local Ray: the resume starts from storage
        out = grpo(config=None, run_id="async-x", resume=True, storage=root, overrides=["grpo.max_num_steps=4"])
    finally:
        kill_run_actors("async-x")
    assert out["restored"]["restored_from"].endswith("step_000002"), out["restored"]
    m = storage.read_manifest(os.path.join(root, "async-x", "steps", "step_000004", "rollouts"))
    assert m.meta["weights_version"] == 2
    ref = async_run["root"]
    assert [train_checksum(root, "async-x", s) for s in (1, 2, 3, 4)] == [
        train_checksum(ref, ASYNC_RUN_ID, s) for s in (1, 2, 3, 4)
    ]


def test_generate_refuses_an_unscheduled_version(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    from flows.config import load_config
    from nrl_tasks.stages.generate import generate

    cfg = load_config(tiny_run_config(tiny_model_dir, str(tmp_path), ray_session, **ASYNC))

    class Ctx:  # the far side of the check: a step context that has only what it reads
        step, cfg = 3, None

    ctx = Ctx()
    ctx.cfg = cfg
    with pytest.raises(ValueError, match="generate of step 3: asked for weights version 2, the run's schedule generates it on version 1"):
        generate.fn(ctx, None, 2)
