"""Refit partner gone mid-broadcast with two generation workers (slow; real faults, test hook ``NRL_FAULT_KILL_ACTOR_AT``), on a
run with two generation workers whose policy holds the reference run's weights after step 3
while the workers still hold the initial ones (so mixed weights would show):

- a consumer SIGKILLed inside the packed broadcast: the attempt fails, the abort leaves the
  surviving worker stale (it refuses ``generate`` for any version), the flow's recovery
  re-creates the dead worker (the group) and a new communicator, and every worker ends with
  exactly the policy's weights;
- a consumer frozen (``SIGSTOP``: neither answers nor dies) inside the broadcast: the attempt
  hits its deadline, is aborted, and the recovery finds the worker unresponsive, re-creates it and
  refits.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from prefect.utilities.annotations import quote

from tests.faults.helpers import read_fault_log
from tests.fixtures.grpo_runs import E2E_RUN_ID, kill_run_actors, tiny_run_config

pytestmark = pytest.mark.slow

RUN_ID = "faults-refit"
VERSION = 3


@pytest.fixture(scope="module")
def two_worker_rt(e2e_run, prefect_harness, ray_session, tiny_model_dir, tmp_path_factory):
    from flows.config import load_config
    from flows.run.runtime import setup_runtime
    from nrl_tasks.stages.checkpoint import restore_checkpoint

    root = str(tmp_path_factory.mktemp("refit"))
    data = tiny_run_config(
        tiny_model_dir, root, ray_session,
        **{
            "generation.num_workers": 2, "generation.num_cpus_per_worker": 0.5, "generation.refit_timeout_s": 8.0,
            "grpo.refit.timeout_s": 8.0,
        },
    )
    cfg = load_config(data)
    from flows.run.plugins import load_observers
    from flows.run.runtime import build_run_context

    rt = setup_runtime(cfg, RUN_ID)
    ck = os.path.join(e2e_run["root"], E2E_RUN_ID, "checkpoints", f"step_{VERSION:06d}")
    restore_checkpoint(rt.policy, ck)
    assert rt.policy.weights_version == VERSION and rt.generation.weights_version == 0
    yield {"rt": rt, "cfg": cfg, "root": root, "run": build_run_context(cfg, RUN_ID, rt, rt.tokenizer, load_observers())}
    kill_run_actors(RUN_ID)


def _stale_refusal(worker, version) -> None:
    import ray

    from nrl_tasks.models.generation.interfaces import StaleWeightsError

    shard = {"input_ids": torch.tensor([[5, 6, 7]]), "input_lengths": torch.tensor([3])}
    with pytest.raises(ray.exceptions.RayTaskError) as ei:
        ray.get(worker.generate.remote(shard, False, weights_version=version), timeout=60)
    assert isinstance(ei.value.cause, StaleWeightsError), ei.value


def _refit_like_the_flow(run, step: int):
    """What the flow does about a failed refit: the attempt fails (aborted, recorded on the run), the
    workers that are dead or stuck are re-created (:mod:`flows.run.recovery`), the refit runs again."""
    from flows.run.runtime import recreate_generation
    from nrl_tasks.stages.errors import is_actor_fault
    from nrl_tasks.stages.health import generation_responsive
    from nrl_tasks.stages.refit import refit

    ctx = quote(run.step(step))
    try:
        return refit(ctx, None, VERSION, force=True)
    except Exception as exc:  # noqa: BLE001 - inspected
        assert is_actor_fault(exc), repr(exc)
    if generation_responsive(run.generation) is None:
        recreate_generation(run.actors, "a worker is dead or does not answer")
    return refit(ctx, None, VERSION, force=True)


def _env(**kv):
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_consumer_killed_mid_broadcast_survivor_stale_then_retry(two_worker_rt, tmp_path):
    from nrl_tasks.stages.errors import is_actor_fault
    from nrl_tasks.stages.refit import abort_refit, refit_weights
    from tests.faults import injection as faults

    rt = two_worker_rt["rt"]
    log = str(tmp_path / "faults.jsonl")
    _env(**{faults.ACTOR_ENV_VAR: "generation#1:refit@301:sigkill", faults.LOG_ENV_VAR: log})
    try:
        with pytest.raises(Exception) as ei:
            refit_weights(
                rt.policy, rt.generation, VERSION, timeout_s=8.0,
                on_actor_call=lambda role, workers: faults.arm_actor_kill(role, "refit", 301, workers),
            )
    finally:
        _env(**{faults.ACTOR_ENV_VAR: None, faults.LOG_ENV_VAR: None})
    assert is_actor_fault(ei.value), repr(ei.value)
    assert read_fault_log(log)[0]["inside"] == ["packed_broadcast_consumer"]
    info = abort_refit(rt, ei.value, 1)
    assert info["generation"][1]["alive"] is False and info["generation"][0]["alive"] is not False, info
    assert info["generation"][0].get("stale", True)  # worker 1 died; the abort left worker 0 stale
    import ray

    state = ray.get(rt.generation.workers[0].get_weights_state.remote(), timeout=60)
    if state["stale"]:  # it refuses: neither the new, nor the old, nor "any" weights
        for version in (VERSION, 0, None):
            _stale_refusal(rt.generation.workers[0], version)
    else:  # it had received every byte before the abort: then it holds exactly the policy's weights
        assert state["weights_version"] == VERSION
        assert ray.get(rt.generation.workers[0].weights_checksum.remote()) == rt.policy.weights_checksum()

    out = _refit_like_the_flow(two_worker_rt["run"], 302)
    assert out.attempts == 2 and out.weights_version == VERSION  # the first attempt met the dead worker
    assert rt.generation.weights_version == VERSION
    assert rt.generation.weights_checksum() == rt.policy.weights_checksum()


def test_consumer_frozen_mid_broadcast_deadline_then_retry(two_worker_rt, tmp_path):
    import psutil

    from tests.faults import injection as faults

    rt = two_worker_rt["rt"]
    rt.generation.mark_stale()  # force a full refit below (workers hold VERSION after the test above)
    log = str(tmp_path / "faults.jsonl")
    _env(**{faults.ACTOR_ENV_VAR: "generation#0:refit@401:freeze", faults.LOG_ENV_VAR: log, "NRL_PROBE_TIMEOUT_S": "3"})
    t0 = time.monotonic()
    try:
        out = _refit_like_the_flow(two_worker_rt["run"], 401)
    finally:
        _env(**{faults.ACTOR_ENV_VAR: None, faults.LOG_ENV_VAR: None, "NRL_PROBE_TIMEOUT_S": None})
        for e in read_fault_log(log):  # the frozen process is ours to end
            try:
                os.kill(e["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    elapsed = time.monotonic() - t0
    events = read_fault_log(log)
    assert events and events[0]["how"] == "freeze" and events[0]["fired"] is True
    assert not psutil.pid_exists(events[0]["pid"]) or psutil.Process(events[0]["pid"]).status() == psutil.STATUS_ZOMBIE
    assert out.attempts == 2 and len(out.get("failed_attempts")) == 1
    failure = out.get("failed_attempts")[0]
    assert "deadline" in failure["error"], failure
    assert failure["generation"][0]["alive"] is None  # frozen: did not answer the abort
    assert failure["generation"][1]["alive"] is not False and failure["generation"][1].get("stale", True)
    assert elapsed < 8.0 + 5.0 + 60.0  # one deadline, one abort, one re-creation: bounded
    assert rt.generation.weights_version == VERSION
    assert rt.generation.weights_checksum() == rt.policy.weights_checksum()
