"""LoRA GRPO through the real flow (``configs/grpo_tiny_lora.yaml`` on the tiny model, 2 steps):
the run completes with checksum-verified adapters-only refits (the metrics line's ``refit_mb`` is
the adapters' bytes, a fraction of the model's), the step-2 checkpoint holds a peft adapter and
the generation logprobs agree with the policy's for the same tokens. (On the tiny arithmetic task
every reward is 0, so the adapters stay at B = 0 here; refit of trained adapters through the
packed broadcast is ``tests/models/test_lora.py::test_refit_of_trained_adapters_over_ray``.)"""

from __future__ import annotations

import os

import pytest
import yaml

from tests.flows.conftest import kill_run_actors, tiny_run_config


def test_lora_grpo_two_steps(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    import storage
    from flows.algorithms.grpo import grpo

    with open("configs/grpo_tiny_lora.yaml", encoding="utf-8") as fh:
        lora = yaml.safe_load(fh)["policy"]["dtensor_cfg"]["lora_cfg"]
    root = str(tmp_path / "runs")
    # verify_checksum: after each refit the generation workers' weights checksum must equal the
    # policy's (the adapter tensors, cast as sent)
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{"grpo.max_num_steps": 2, "grpo.refit.verify_checksum": True})
    cfg["policy"]["dtensor_cfg"] = {"lora_cfg": lora}
    try:
        out = grpo(config=cfg, run_id="lora-tiny")
    finally:
        kill_run_actors("lora-tiny")
    assert out["final_metrics"]["step"] == 2
    from flows.observe.metrics import read_metrics
    from nrl_tasks.models.generation.hf_worker import hf_refit_named_tensors
    from transformers import AutoModelForCausalLM

    full = sum(t.numel() * t.element_size() for _, t in hf_refit_named_tensors(AutoModelForCausalLM.from_pretrained(tiny_model_dir)))
    sent = [r.get("refit_mb") for r in read_metrics(out["metrics_uri"])]
    assert sent[0] is not None and all(mb == sent[0] for mb in sent), sent
    assert 0 < sent[0] * 1e6 < 0.25 * full, (sent, full)
    weights = os.path.join(root, "lora-tiny", "checkpoints", "step_000002", "weights")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(weights))
    # step 2 generates with the weights refit after step 1's train: the merged adapters
    step = os.path.join(root, "lora-tiny", "steps", "step_000002")
    gen = storage.load_batch(os.path.join(step, "rollouts"), columns=["generation_logprobs", "token_mask"])
    lp = storage.load_batch(os.path.join(step, "logprobs"))
    mask = gen["token_mask"][:, 1:].bool()
    diff = (gen["generation_logprobs"][:, 1:] - lp["prev_logprobs"][:, 1:]).abs()[mask]
    assert bool(mask.any()) and float(diff.max()) < 1e-3, float(diff.max())
    # the eval sweep evaluates the adapter checkpoints as they are (base + adapter, merged on load)
    from flows.algorithms.evaluate import eval_sweep

    res = eval_sweep("lora-tiny", storage=root, num_samples=2, max_prompts=4)
    assert sorted(res["evaluated"]) == ["lora-tiny/step_000002"], res
    assert [r["accuracy"] is not None for r in res["rows"]] == [True]


@pytest.mark.slow
def test_lora_async_with_two_data_parallel_ranks(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    """LoRA with async GRPO (age 1) and 2 data-parallel policy ranks, a reward that varies (the
    adapters train): 3 steps complete with checksum-verified adapters-only refits, each step's
    rollouts come from the version the async schedule names, and the adapters moved every step."""
    import storage
    from flows.algorithms.grpo import grpo
    from flows.observe.metrics import read_metrics

    with open("configs/grpo_tiny_lora.yaml", encoding="utf-8") as fh:
        lora = yaml.safe_load(fh)["policy"]["dtensor_cfg"]["lora_cfg"]
    root = str(tmp_path / "runs")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{
        "grpo.refit.verify_checksum": True, "grpo.async_grpo.enabled": True, "grpo.async_grpo.max_trajectory_age_steps": 1,
        "loss_fn.use_importance_sampling_correction": True, "cluster.policy_workers": 2,
        "env.reward_fn": "tests.flows.test_dynamic_sampling:parity_reward",
    })
    cfg["policy"]["dtensor_cfg"] = {"lora_cfg": lora}
    try:
        out = grpo(config=cfg, run_id="lora-async-dp2")
    finally:
        kill_run_actors("lora-async-dp2")
    rows = read_metrics(out["metrics_uri"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    steps = os.path.join(root, "lora-async-dp2", "steps")
    versions = [storage.read_manifest(os.path.join(steps, f"step_{s:06d}", "rollouts")).meta["weights_version"] for s in (1, 2, 3)]
    assert versions == [0, 0, 1], versions  # max(0, N-1-age)
    sums = [storage.read_manifest(os.path.join(steps, f"step_{s:06d}", "train")).meta["weights_checksum"] for s in (1, 2, 3)]
    assert len(set(sums)) == 3, sums
    assert all(r.get("refit_mb") for r in rows if r.get("refit_attempts")), rows
