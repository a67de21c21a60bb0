"""A colocated GRPO run (``generation.colocated.enabled``: the policy workers sample, no
generation actors) learns exactly like the session's separate-worker run of the same config (the
same sampling call on the same weights and seeds) and resumes bit-identically: SIGKILLed after
``generate`` of step 3 computed, resumed on the still-live policy actors (attached: the colocated
side starts again at version 0 and the resume's refit records the policy's version), SIGKILLed
again during ``train`` of step 3, and resumed on fresh actors."""

from __future__ import annotations

import signal

import pytest
import yaml

from tests.faults.helpers import checkpoint_bytes, run_nrl, train_checksum
from tests.fixtures.grpo_runs import E2E_RUN_ID, kill_run_actors, tiny_run_config


def _groups(run_id: str) -> dict[str, bool]:
    from nrl_tasks.distributed.worker_groups import RayWorkerGroup
    from nrl_tasks.run_layout import namespace_for

    found = {}
    for prefix in ("lm_policy", "generation"):
        try:
            RayWorkerGroup.attach(prefix, namespace_for(run_id))
            found[prefix] = True
        except LookupError:
            found[prefix] = False
    return found


@pytest.mark.slow
def test_colocated_run_learns_like_separate_workers_and_resumes_bit_identical(
    e2e_run, prefect_harness, ray_session, tiny_model_dir, tmp_path
):
    root = str(tmp_path / "runs")
    cfg_path = tmp_path / "cfg.yaml"
    overrides = {"generation.colocated.enabled": True, "grpo.val_period": 2}  # the session run's validation too
    cfg_path.write_text(yaml.safe_dump(tiny_run_config(tiny_model_dir, root, ray_session, **overrides)))
    run = "colocated"
    try:
        p = run_nrl(["grpo", "--config", str(cfg_path), "--run-id", run], prefect_harness, kill_at="generate@3:during")
        assert p.returncode == -signal.SIGKILL, p.stdout[-3000:] + p.stderr[-3000:]
        assert _groups(run) == {"lm_policy": True, "generation": False}  # sampling ran in the policy workers
        p = run_nrl(["resume", run, "--storage", root], prefect_harness, kill_at="train@3:during")
        assert p.returncode == -signal.SIGKILL, p.stdout[-3000:] + p.stderr[-3000:]
        kill_run_actors(run)  # fresh actors: restore checkpoint 2, generate step 3 on it again
        p = run_nrl(["resume", run, "--storage", root], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        kill_run_actors(run)
    ref_root = e2e_run["root"]
    for step in (2, 3):
        assert checkpoint_bytes(root, run, step) == checkpoint_bytes(ref_root, E2E_RUN_ID, step), step
    for step in (1, 2, 3):
        assert train_checksum(root, run, step) == train_checksum(ref_root, E2E_RUN_ID, step), step
