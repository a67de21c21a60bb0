"""The algorithm menu through the real flow (tiny model, 2 steps): REINFORCE++ with the KL in the
reward (per-token advantages; the ``advantages`` stage reads the step's ``logprobs``), DAPO's
clip-higher, VAPO's positive-example NLL, ICE-POP truncated importance sampling and DAPO's overlong
reward shaping in one run; the run completes, persists per-token advantages, shaped rewards and
the new loss metrics."""

from __future__ import annotations

import os

from tests.flows.conftest import kill_run_actors, tiny_run_config

MENU = {
    "grpo.max_num_steps": 2,
    "grpo.adv_estimator.name": "reinforce_plus_plus",
    "loss_fn.use_kl_in_reward": True,
    "loss_fn.reference_policy_kl_penalty": 0.05,
    "loss_fn.ratio_clip_max": 0.28,
    "loss_fn.positive_example_nll_weight": 0.1,
    "loss_fn.use_importance_sampling_correction": True,
    "loss_fn.truncated_importance_sampling_type": "icepop",
    "loss_fn.truncated_importance_sampling_ratio": 5.0,
    "loss_fn.truncated_importance_sampling_ratio_min": 0.5,
    "grpo.reward_shaping.enabled": True,
    "grpo.reward_shaping.overlong_buffer_length": 4,
}


def test_reinforce_plus_plus_and_loss_variants_run_end_to_end(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    import storage
    from flows.algorithms.grpo import grpo

    root = str(tmp_path / "runs")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **MENU)
    try:
        out = grpo(config=cfg, run_id="algo-menu")
    finally:
        kill_run_actors("algo-menu")
    assert out["final_metrics"]["step"] == 2
    step = os.path.join(root, "algo-menu", "steps", "step_000001")
    adv = storage.load_batch(os.path.join(step, "advantages"))
    rollouts = storage.load_batch(os.path.join(step, "rollouts"), columns=["token_mask"])
    assert adv["advantages"].shape == rollouts["token_mask"].shape  # per token
    assert "rewards" in adv  # VAPO reads it
    import torch

    from nrl_tasks.algorithms.reward_shaping import overlong_penalty

    rw = storage.load_batch(os.path.join(step, "rewards"))
    lengths = storage.load_batch(os.path.join(step, "rollouts"), columns=["generation_lengths"])["generation_lengths"]
    want = rw["task_rewards"] + overlong_penalty(lengths, 8, 4, 1.0)  # tiny: max_new_tokens 8
    assert torch.equal(rw["rewards"][rw["reward_valid"]], want[rw["reward_valid"]])
    train = storage.load_batch(os.path.join(step, "train"))
    for key in ("probs_ratio_min", "probs_ratio_max", "gen_kl_error", "policy_kl_error", "js_divergence_error",
                "is_oob_ratio", "positive_nll_loss"):
        assert key in train, key
    assert float(train["probs_ratio"][0]) > 0.5  # summed over micro-batches: ~1 on the first update
