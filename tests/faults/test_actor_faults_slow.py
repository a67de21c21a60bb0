"""More actor faults (slow): the remaining stage calls, and a data-parallel policy losing one rank.

- one 3-step run suffers ``policy:logprob@1`` (fresh actors, nothing to replay),
  ``policy:refit@1`` (the producer dies mid-broadcast: the refit retry re-creates the policy and
  replays step 1), ``policy:checkpoint@2:sigkill`` (the worker dies while writing checkpoint 2:
  nothing half-written is committed; the retry re-creates it, replays steps 1-2 and writes the
  checkpoint) and ``generation:generate@3:sigkill``; it must end bit-identical to the reference;
- a run with two policy ranks loses rank 1 inside ``train`` of step 2 while rank 0 waits for it in
  the gradient all-reduce: the whole group is re-created (no waiting on the stuck rank), step 1 is
  replayed and verified against its recorded checksum, and the run completes.
"""

from __future__ import annotations

import os

import pytest

from tests.faults.helpers import assert_same_rollouts, checkpoint_bytes, fired, read_fault_log, retries_of, train_checksum
from tests.fixtures.grpo_runs import E2E_RUN_ID, kill_run_actors, tiny_run_config

pytestmark = pytest.mark.slow


def _run(cfg: dict, run_id: str, faults_spec: str, log: str) -> dict:
    from flows.algorithms.grpo import grpo
    from tests.faults import injection as faults

    env = {faults.ACTOR_ENV_VAR: faults_spec, faults.LOG_ENV_VAR: log}
    os.environ.update(env)
    try:
        return grpo(config=cfg, run_id=run_id)
    finally:
        for k in env:
            os.environ.pop(k, None)
        kill_run_actors(run_id)


def test_more_actor_faults_one_run(e2e_run, prefect_harness, ray_session, tiny_model_dir, tmp_path):
    import storage

    run_id = "faults-more"
    root = str(tmp_path / "runs")
    log = str(tmp_path / "faults.jsonl")
    spec = "policy:logprob@1, policy:refit@1, policy:checkpoint@2:sigkill, generation:generate@3:sigkill"
    _run(tiny_run_config(tiny_model_dir, root, ray_session, **{"grpo.refit.timeout_s": 20.0}), run_id, spec, log)
    events = read_fault_log(log)
    for role, stage, step in (("policy", "logprob", 1), ("policy", "refit", 1), ("policy", "checkpoint", 2), ("generation", "generate", 3)):
        assert fired(events, role, stage, step), (role, stage, step, events)
    base = e2e_run["root"]
    for step in (1, 2, 3):
        assert_same_rollouts(root, run_id, base, E2E_RUN_ID, step)
        assert train_checksum(root, run_id, step) == train_checksum(base, E2E_RUN_ID, step)
    for step in (2, 3):
        assert checkpoint_bytes(root, run_id, step) == checkpoint_bytes(base, E2E_RUN_ID, step)
    ckdir = os.path.join(root, run_id, "checkpoints")
    assert sorted(os.listdir(ckdir)) == ["step_000002", "step_000003"]  # no half-written leftovers
    for name in (f"logprob-{run_id}-step1", f"checkpoint-{run_id}-step2", f"generate-{run_id}-step3"):
        assert retries_of(name) == 1, name
    assert storage.read_manifest(os.path.join(root, run_id, "steps", "step_000003", "rollouts")).meta["recovered"]


def test_dp2_rank_killed_during_train(e2e_run, prefect_harness, ray_session, tiny_model_dir, tmp_path):
    import storage

    run_id = "faults-dp2"
    root = str(tmp_path / "runs")
    log = str(tmp_path / "faults.jsonl")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{"cluster.policy_workers": 2})
    result = _run(cfg, run_id, "policy#1:train@2", log)
    assert result["last_step"] == 3
    assert fired(read_fault_log(log), "policy", "train", 2)["rank"] == 1
    meta = storage.read_manifest(os.path.join(root, run_id, "steps", "step_000002", "train")).meta
    assert meta["recovered"] is True and meta["replayed"] == "1"  # step 1 replayed, its checksum verified
    assert retries_of(f"train-{run_id}-step2") == 1
