"""``loss_fn.force_on_policy_ratio`` without a KL term: nothing reads the step's logprobs, so the
``logprob`` stage does not run (no dataset, ``logprob_skipped`` in the metrics line), and a resume
that replays every step from the initial weights (no checkpoints) reproduces each recorded
weights checksum without them."""

from __future__ import annotations

import os

import pytest

from tests.flows.conftest import kill_run_actors, tiny_run_config

ON_POLICY = {"loss_fn.force_on_policy_ratio": True, "loss_fn.reference_policy_kl_penalty": 0.0,
             "checkpointing.enabled": False}


@pytest.mark.slow  # a whole flow run (+ resume): keeps make test under 15 minutes
def test_logprob_stage_skipped_and_resume_replays_without_it(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    import storage
    from flows.algorithms.grpo import grpo
    from flows.observe.metrics import read_metrics

    root = str(tmp_path / "runs")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **ON_POLICY)
    try:
        grpo(config=cfg, run_id="no-lp")
        kill_run_actors("no-lp")  # the resume restores the initial weights and replays 1..3
        out = grpo(config=None, run_id="no-lp", resume=True, storage=root, overrides=["grpo.max_num_steps=4"])
    finally:
        kill_run_actors("no-lp")
    assert out["restored"]["replayed"] == [1, 2, 3]  # each replay checked against its recorded checksum
    rows = read_metrics(os.path.join(root, "no-lp", "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r.get("logprob_skipped") for r in rows)
    for s in (1, 4):
        step = os.path.join(root, "no-lp", "steps", f"step_{s:06d}")
        assert not storage.is_committed(os.path.join(step, "logprobs")) and storage.is_committed(os.path.join(step, "train"))


def test_force_on_policy_ratio_needs_one_update_per_batch(tiny_model_dir):
    from flows.config import load_config
    from flows.config.io import ConfigError
    from tests.fixtures.grpo_runs import TINY_CONFIG

    with pytest.raises(ConfigError) as ei:
        load_config(TINY_CONFIG, ["loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=8"])
    assert "force_on_policy_ratio" in str(ei.value) and "train_global_batch_size" in str(ei.value)
