"""Actors killed in the middle of their work during a GRPO run (real kills, test hook
``NRL_FAULT_KILL_ACTOR_AT``): after each fault the flow's recovery re-creates what died and
restores it from what is persisted, the step runs again, and the run ends bit-identical to the uninterrupted reference (``e2e_run``, same
config and seed; its validation and refit retries do not touch the policy).

One 3-step run (in this process, Prefect test server, the session's Ray) suffers, in order:

- ``generation:generate@2`` (``ray.kill`` while sampling): the generate retry re-creates the
  worker, refits it fully to version 1 and regenerates step 2 with the persisted seeds;
- ``policy:train@2`` (``ray.kill`` inside ``train``, no checkpoint yet): the train retry
  re-creates the worker group, replays ``train`` of step 1 from its persisted batches and trains 2;
- ``generation:refit@2:freeze`` (the consumer hangs mid-broadcast, neither answering nor dying):
  the refit attempt hits its deadline and is aborted; the retry finds the worker unresponsive,
  re-creates it and refits over a new communicator;
- ``policy:train@3:sigkill``: the train retry restores checkpoint 2 and trains 3.

Then, on the run's live actors, the producer (policy) is killed inside the packed broadcast:
the surviving generation worker is left stale and refuses to generate, and the next refit
re-creates and restores the policy (checkpoint 3) before streaming.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.faults.helpers import (
    assert_same_rollouts,
    checkpoint_bytes,
    env_vars,
    fired,
    read_fault_log,
    retries_of,
    task_runs,
    train_checksum,
)
from tests.fixtures.grpo_runs import E2E_RUN_ID, kill_run_actors, tiny_run_config

#: whole flow runs killed and recovered (~4 min): the slow suite, so make test stays under 10 minutes
pytestmark = pytest.mark.slow

RUN_ID = "faults-actors"
FAULTS = "generation:generate@2, policy:train@2, generation:refit@2:freeze, policy:train@3:sigkill"


@pytest.fixture(scope="module")
def faulted_run(e2e_run, prefect_harness, ray_session, tiny_model_dir, tmp_path_factory):
    from flows.algorithms.grpo import grpo
    from tests.faults import injection as faults

    root = str(tmp_path_factory.mktemp("faulted"))
    log = os.path.join(root, "faults.jsonl")
    cfg = tiny_run_config(
        tiny_model_dir, root, ray_session, **{"grpo.refit.timeout_s": 6.0, "generation.refit_timeout_s": 6.0}
    )
    env = {faults.ACTOR_ENV_VAR: FAULTS, faults.LOG_ENV_VAR: log, "NRL_KEEP_ACTORS": "1", "NRL_PROBE_TIMEOUT_S": "3"}
    try:
        with env_vars(env):
            result = grpo(config=cfg, run_id=RUN_ID)
    finally:
        for e in read_fault_log(log):  # a frozen worker's process is ours to end
            if e.get("how") == "freeze":
                try:
                    os.kill(e["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
    yield {"root": root, "cfg": cfg, "log": read_fault_log(log), "result": result, "baseline": e2e_run["root"]}
    kill_run_actors(RUN_ID)


def test_every_fault_landed_inside_its_call(faulted_run):
    log = faulted_run["log"]
    for role, stage, step in (("generation", "generate", 2), ("policy", "train", 2), ("generation", "refit", 2), ("policy", "train", 3)):
        assert fired(log, role, stage, step), (role, stage, step, log)
    # the ray.kill ones froze the actor inside the call before killing it
    assert fired(log, "generation", "generate", 2)["fired"] is True
    assert fired(log, "policy", "train", 2)["fired"] is True


def test_generation_worker_killed_during_generate_regenerates_same_rollouts(faulted_run):
    import storage

    root, base = faulted_run["root"], faulted_run["baseline"]
    for step in (1, 2, 3):
        assert_same_rollouts(root, RUN_ID, base, E2E_RUN_ID, step)
    meta = storage.read_manifest(os.path.join(root, RUN_ID, "steps", "step_000002", "rollouts")).meta
    assert meta["recovered"] is True and meta["weights_version"] == 1
    assert retries_of(f"generate-{RUN_ID}-step2") == 1  # one retry


def test_policy_worker_killed_during_train_replays_and_matches(faulted_run):
    root, base = faulted_run["root"], faulted_run["baseline"]
    for step in (1, 2, 3):
        assert train_checksum(root, RUN_ID, step) == train_checksum(base, E2E_RUN_ID, step)
    assert checkpoint_bytes(root, RUN_ID, 3) == checkpoint_bytes(base, E2E_RUN_ID, 3)
    assert checkpoint_bytes(root, RUN_ID, 2) == checkpoint_bytes(base, E2E_RUN_ID, 2)
    for step in (2, 3):
        assert retries_of(f"train-{RUN_ID}-step{step}") == 1, step
    rows = faulted_run["result"]["final_metrics"]
    assert rows["step"] == 3


def test_metrics_lines_count_the_attempts(faulted_run):
    """Each retried stage shows the attempt that succeeded in its step's metrics line."""
    from flows.observe.metrics import read_metrics

    rows = read_metrics(os.path.join(faulted_run["root"], RUN_ID, "metrics.jsonl"))
    got = {r["step"]: (r["generate_attempts"], r["logprob_attempts"], r["train_attempts"], r["refit_attempts"]) for r in rows}
    assert got == {1: (1, 1, 1, 1), 2: (2, 1, 2, 2), 3: (1, 1, 2, 1)}, got
    assert rows[1]["checkpoint_attempts"] == rows[2]["checkpoint_attempts"] == 1


def test_refit_consumer_frozen_hits_deadline_and_is_retried(faulted_run):
    e = fired(faulted_run["log"], "generation", "refit", 2)
    assert e["how"] == "freeze" and e["fired"] is True
    assert retries_of(f"refit-{RUN_ID}-v2") == 1  # the deadline, then a successful retry


def _refuses(worker, version) -> None:
    import ray

    from nrl_tasks.models.generation.interfaces import StaleWeightsError

    shard = {"input_ids": torch.tensor([[5, 6, 7]]), "input_lengths": torch.tensor([3])}
    with pytest.raises(ray.exceptions.RayTaskError) as ei:
        ray.get(worker.generate.remote(shard, False, weights_version=version), timeout=60)
    assert isinstance(ei.value.cause, StaleWeightsError), ei.value


def test_refit_producer_killed_mid_broadcast(faulted_run):
    """The policy (producer) dies inside the packed broadcast: the attempt fails, the abort
    leaves the generation worker stale (it refuses every version), and the recovery re-creates
    the policy, restores checkpoint 3 and streams over a new communicator."""
    import ray

    from flows.algorithms.grpo import GRPO
    from flows.config import load_config
    from flows.run.recovery import recover
    from flows.run.runtime import build_run_context, setup_runtime
    from nrl_tasks.stages.errors import is_actor_fault
    from nrl_tasks.stages.refit import abort_refit, refit_weights
    from tests.faults import injection as faults

    cfg = load_config(faulted_run["cfg"])
    rt = setup_runtime(cfg, RUN_ID)  # attaches to the run's kept actors
    run = build_run_context(cfg, RUN_ID, rt, rt.tokenizer)
    want = train_checksum(faulted_run["root"], RUN_ID, 3)
    old_pid = rt.policy.worker_status()[0]["pid"]
    os.environ[faults.ACTOR_ENV_VAR] = "policy:refit@203"
    try:
        with pytest.raises(Exception) as ei:
            refit_weights(
                rt.policy, rt.generation, 3, timeout_s=20.0,
                on_actor_call=lambda role, workers: faults.arm_actor_kill(role, "refit", 203, workers),
            )
    finally:
        os.environ.pop(faults.ACTOR_ENV_VAR, None)
    assert is_actor_fault(ei.value), repr(ei.value)
    info = abort_refit(run, ei.value, 1)
    assert info["generation"][0]["alive"] is not False, info  # the consumer survived (maybe still unwinding)
    assert info["generation"][0].get("stale", True), info
    worker = rt.generation.workers[0]
    state = ray.get(worker.get_weights_state.remote(), timeout=60)
    if state["stale"]:  # neither the new, nor the old, nor "any" weights
        for version in (3, 2, None):
            _refuses(worker, version)
    else:  # every byte had arrived before the producer died: then they are exactly the trained weights
        assert state["weights_version"] == 3 and ray.get(worker.weights_checksum.remote()) == want

    out = recover(run, GRPO, 3)  # what the flow does after the failed refit
    assert out["plan"].recreate_policy and out["plan"].refit and out["restored_from"].endswith("step_000003")
    assert rt.policy.worker_status()[0]["pid"] != old_pid  # re-created, restored from checkpoint 3
    assert rt.policy.weights_checksum() == want
    assert rt.generation.weights_version == 3 and rt.generation.weights_checksum() == want


def test_stage_retries_zero_fails_the_stage_on_an_actor_fault(prefect_harness, ray_session, tiny_model_dir, tmp_path):
    """``grpo.stage_retries=0``: the same actor kill that a default run rides out (above) fails
    the ``train`` task at its first attempt, and with it the run (status ``failed``, step not trained)."""
    import json

    from flows.algorithms.grpo import grpo
    from tests.faults import injection as faults
    from nrl_tasks.stages.errors import is_actor_fault

    run_id = "faults-no-stage-retry"
    root = str(tmp_path)
    log = os.path.join(root, "faults.jsonl")
    cfg = tiny_run_config(
        tiny_model_dir, root, ray_session,
        **{"grpo.max_num_steps": 1, "grpo.stage_retries": 0, "checkpointing.enabled": False},
    )
    env = {faults.ACTOR_ENV_VAR: "policy:train@1", faults.LOG_ENV_VAR: log, "NRL_KEEP_ACTORS": "0"}
    try:
        with env_vars(env), pytest.raises(BaseException) as ei:
            grpo(config=cfg, run_id=run_id)
    finally:
        kill_run_actors(run_id)
    assert fired(read_fault_log(log), "policy", "train", 1)["fired"] is True
    assert is_actor_fault(ei.value), repr(ei.value)
    runs = task_runs(f"train-{run_id}-step1")
    assert [t.run_count for t in runs] == [1] and runs[0].state.is_failed()  # no second attempt
    status = json.loads(open(os.path.join(root, run_id, "status.json")).read())
    assert status["status"] == "failed"
    assert not os.path.exists(os.path.join(root, run_id, "steps", "step_000001", "train", "_manifest.json"))
