"""Async GRPO (age 1, 4 steps, ``async_run`` as the uninterrupted reference) through real faults:
the flow process SIGKILLed then ``nrl resume``, and actors killed in the middle of their calls
while the two lanes overlap. Each run ends with the reference's weights, step for step, and
every step's rollouts come from exactly its scheduled weights version, bit for bit the same.

- ``train@3:during`` (flow SIGKILLed with the update of step 3 done, not committed, while step 4
  generates on version 2): the resume finds step 4's rollouts committed or not and, when not,
  generates them on version 2 (restore checkpoint 2), then trains 3 and 4;
- ``generate@4:during`` (slow suite; step 4 half-generated while step 3 trains): the resume
  generates step 4 on version 2, from checkpoint 2 and a replay when step 3 was trained;
- ``generation:generate@3`` (``ray.kill`` of the generation worker while it samples step 3,
  during ``train 2``): the refit after ``train 2`` reports it; recovery re-creates the worker,
  restores the initial weights (step 3 needs version 1; checkpoint 2 is newer), generates step 3
  on version 1 while replaying, and the run goes on;
- ``policy:train@3`` (``ray.kill`` inside ``train`` of step 3, step 4 generating): recovery
  re-creates the policy from checkpoint 2 and trains 3 again.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import yaml

from tests.faults.helpers import assert_same_rollouts, env_vars, fired, read_fault_log, run_nrl, train_checksum
from tests.fixtures.grpo_runs import ASYNC_OVERRIDES, ASYNC_RUN_ID, kill_run_actors, tiny_run_config

#: whole flow runs killed and recovered (~4 min): the slow suite, so make test stays under 10 minutes
pytestmark = pytest.mark.slow

STEPS = (1, 2, 3, 4)


def _same_as_reference(root: str, run_id: str, async_run: dict) -> None:
    import storage
    from flows.observe.metrics import read_metrics
    from nrl_tasks.stages.schedule import StepSchedule

    ref = async_run["root"]
    assert [train_checksum(root, run_id, s) for s in STEPS] == [train_checksum(ref, ASYNC_RUN_ID, s) for s in STEPS]
    sched = StepSchedule(4, 1)
    for s in STEPS:
        m = storage.read_manifest(os.path.join(root, run_id, "steps", f"step_{s:06d}", "rollouts"))
        assert m.meta["weights_version"] == sched.generation_version(s), (s, m.meta)
        assert_same_rollouts(root, run_id, ref, ASYNC_RUN_ID, s)
    rows = read_metrics(os.path.join(root, run_id, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(STEPS)
    assert [r["trajectory_age"] for r in rows] == [0, 1, 1, 1]
    assert [r["step"] for r in rows if r.get("val_accuracy") is not None] == [2, 4]
    with open(os.path.join(root, run_id, "status.json"), encoding="utf-8") as fh:
        assert json.load(fh)["status"] == "completed"


def test_reference_async_run_validates_and_records_is_weights(async_run):
    from flows.observe.metrics import read_metrics

    rows = read_metrics(os.path.join(async_run["root"], ASYNC_RUN_ID, "metrics.jsonl"))
    assert [r["step"] for r in rows if r.get("val_accuracy") is not None] == [2, 4]
    for r in rows:
        assert r["is_weight_max"] >= r["is_weight_mean"] > 0, r
    # step 1 is on-policy (version 0 generates, version 0 trains); later steps one version old
    assert abs(rows[0]["is_weight_mean"] - 1.0) < 0.05, rows[0]


def _kill_and_resume(kill_at: str, run_id: str, tmp_path, prefect_harness, ray_session, tiny_model_dir, async_run):
    root = str(tmp_path / "runs")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **ASYNC_OVERRIDES)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    try:
        p = run_nrl(["grpo", "--config", str(cfg_path), "--run-id", run_id], prefect_harness, kill_at=kill_at)
        assert p.returncode == -signal.SIGKILL, (kill_at, p.stderr[-3000:])
        kill_run_actors(run_id)  # the actors go with the flow process (a local Ray)
        p = run_nrl(["resume", run_id, "--storage", root], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        kill_run_actors(run_id)
    _same_as_reference(root, run_id, async_run)


def test_async_flow_killed_during_step_3_resumes_bit_identical(tmp_path, prefect_harness, ray_session, tiny_model_dir, async_run):
    _kill_and_resume("train@3:during", "async-kill-train3", tmp_path, prefect_harness, ray_session, tiny_model_dir, async_run)


# logprob kills: the synchronous kill matrix (same stage code); here the stages async GRPO overlaps
@pytest.mark.parametrize("kill_at", ["generate@4:during", "refit@2:during", "checkpoint@4:during"])
def test_async_flow_killed_then_resumed(kill_at, tmp_path, prefect_harness, ray_session, tiny_model_dir, async_run):
    run_id = "async-kill-" + kill_at.replace("@", "-").replace(":", "-")
    _kill_and_resume(kill_at, run_id, tmp_path, prefect_harness, ray_session, tiny_model_dir, async_run)


@pytest.mark.parametrize("faults", ["generation:generate@3", "policy:train@3"])
def test_async_actor_killed_mid_call_recovers_in_run(faults, tmp_path, prefect_harness, ray_session, tiny_model_dir, async_run):
    from flows.algorithms.grpo import grpo
    from tests.faults import injection

    role, rest = faults.split(":")
    stage, step = rest.split("@")
    run_id = f"async-{role}-{stage}"
    root = str(tmp_path / "runs")
    log = os.path.join(root, "faults.jsonl")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **ASYNC_OVERRIDES)
    env = {injection.ACTOR_ENV_VAR: faults, injection.LOG_ENV_VAR: log, "NRL_PROBE_TIMEOUT_S": "3"}
    try:
        with env_vars(env):
            grpo(config=cfg, run_id=run_id)
    finally:
        kill_run_actors(run_id)
    assert fired(read_fault_log(log), role, stage, int(step)), read_fault_log(log)
    _same_as_reference(root, run_id, async_run)
