"""A GRPO run on 2 policy ranks with FSDP2 sharding (``policy.dtensor_cfg.enabled``, the
default) SIGKILLed during ``train`` of step 3 (its work done, its output not committed) and again
while it checkpoints, then resumed with ``nrl resume`` on fresh actors: it ends bit-identical to
an uninterrupted sharded run (checkpoint files and every step's weights checksum). Its metrics
lines report the sharded state per rank (at most 0.6 of a one-rank run's)."""

from __future__ import annotations

import os
import signal

import pytest
import yaml

from tests.faults.helpers import checkpoint_bytes, run_nrl, train_checksum
from tests.fixtures.grpo_runs import E2E_RUN_ID, kill_run_actors, tiny_run_config


@pytest.mark.slow
def test_sharded_run_killed_in_train_resumes_bit_identical(e2e_run, prefect_harness, ray_session, tiny_model_dir, tmp_path):
    from flows.observe.metrics import read_metrics

    root = str(tmp_path / "runs")
    cfg_path = tmp_path / "cfg.yaml"
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{"cluster.policy_workers": 2})
    cfg_path.write_text(yaml.safe_dump(cfg))
    ref, run = "fsdp-ref", "fsdp-killed"
    try:
        p = run_nrl(["grpo", "--config", str(cfg_path), "--run-id", ref], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        kill_run_actors(ref)
        p = run_nrl(["grpo", "--config", str(cfg_path), "--run-id", run], prefect_harness, kill_at="train@3:during")
        assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
        kill_run_actors(run)  # fresh actors: restore checkpoint 2, replay nothing, train step 3 again
        p = run_nrl(["resume", run, "--storage", root], prefect_harness, kill_at="checkpoint@3:during")
        assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
        kill_run_actors(run)  # again: restore checkpoint 2, replay the committed train of step 3
        p = run_nrl(["resume", run, "--storage", root], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        kill_run_actors(ref)
        kill_run_actors(run)
    for step in (2, 3):
        assert checkpoint_bytes(root, run, step) == checkpoint_bytes(root, ref, step), step
    for step in (1, 2, 3):
        assert train_checksum(root, run, step) == train_checksum(root, ref, step), step
    rows = read_metrics(os.path.join(root, run, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    one_rank = read_metrics(os.path.join(e2e_run["root"], E2E_RUN_ID, "metrics.jsonl"))
    sharded_mb, full_mb = rows[-1]["policy_state_mb_per_rank"], one_rank[-1]["policy_state_mb_per_rank"]
    assert 0 < sharded_mb <= 0.6 * full_mb, (sharded_mb, full_mb)
