"""``loss_fn.force_on_policy_ratio`` without a KL term: nothing reads the step's logprobs, so the
``logprob`` stage does not run (no dataset, ``logprob_skipped`` in the metrics line), and a resume
that replays every step from the initial weights (no checkpoints) reproduces each recorded
weights checksum without them."""

from __future__ import annotations

import os

import pytest
import torch

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


def test_recipes_keep_the_reference_weights_only_when_a_step_reads_them(tiny_model_dir, tmp_path):
    from flows.algorithms.registry import recipe_for
    from flows.config import load_config
    from tests.fixtures.grpo_runs import TINY_CONFIG

    no_kl = load_config(TINY_CONFIG, ["loss_fn.reference_policy_kl_penalty=0.0"])
    kl = load_config(TINY_CONFIG, ["loss_fn.reference_policy_kl_penalty=0.01"])
    assert [recipe_for(k).reference_weights(no_kl) for k in ("grpo", "ppo")] == [False, False]
    assert [recipe_for(k).reference_weights(kl) for k in ("grpo", "ppo")] == [True, True]
    assert [recipe_for(k).reference_weights(kl) for k in ("sft", "distill", "rm")] == [False, False, False]
    assert recipe_for("dpo").reference_weights(no_kl) is True  # DPO's frozen reference, whatever loss_fn says


@pytest.mark.slow  # two policies on Ray: keeps make test under 10 minutes
def test_a_run_without_a_kl_term_starts_its_policy_without_the_reference_copy(tmp_path, ray_session, tiny_model_dir):
    """The session's runtime asks the recipe: a GRPO run with ``reference_policy_kl_penalty: 0`` keeps no
    copy of the initial weights in its policy workers (a model's worth of memory each), and a call that
    would need them says so."""
    import ray

    from flows.algorithms.registry import recipe_for
    from flows.config import load_config
    from flows.run.recipe import Actors
    from flows.run.runtime import setup_runtime
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

    root = str(tmp_path / "runs")
    kept = {}
    for kl in (0.0, 0.01):
        cfg = load_config(tiny_run_config(tiny_model_dir, root, ray_session, **{"loss_fn.reference_policy_kl_penalty": kl}))
        run_id = f"ref-{int(kl * 100)}"
        try:
            rt = setup_runtime(cfg, run_id, actors=Actors(), reference_weights=recipe_for("grpo").reference_weights(cfg))
            worker = rt.policy.worker_group.workers[0]
            kept[kl] = ray.get(worker.__ray_call__.remote(lambda self: None if self.reference is None else len(self.reference)))
            if kl == 0.0:
                batch = BatchedDataDict({"input_ids": torch.ones(2, 4, dtype=torch.long), "input_lengths": torch.tensor([4, 3])})
                with pytest.raises(Exception, match="init_reference_model=False"):
                    rt.policy.get_reference_policy_logprobs(batch)
        finally:
            kill_run_actors(run_id)
    assert kept[0.0] is None and kept[0.01]  # every parameter's initial value, only with the KL term
