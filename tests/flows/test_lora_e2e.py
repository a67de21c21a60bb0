"""LoRA GRPO through the real flow (``configs/grpo_tiny_lora.yaml`` on the tiny model, 2 steps):
the run completes with checksum-verified adapters-only refits (the metrics line's ``refit_mb`` is
the adapters' bytes, a fraction of the model's), the step-2 checkpoint holds a peft adapter and
the generation logprobs agree with the policy's for the same tokens. (On the tiny arithmetic task
every reward is 0, so the adapters stay at B = 0 here; refit of trained adapters through the
packed broadcast is ``tests/models/test_lora.py::test_refit_of_trained_adapters_over_ray``.)"""

from __future__ import annotations

import os

import yaml

from tests.flows.conftest import kill_run_actors, tiny_run_config


def test_lora_grpo_two_steps(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    import storage
    import torch
    from flows.grpo import grpo

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
    from flows.metrics import read_metrics
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
    from flows.evaluate import eval_sweep

    res = eval_sweep("lora-tiny", storage=root, num_samples=2, max_prompts=4)
    assert sorted(res["evaluated"]) == ["lora-tiny/step_000002"], res
    assert [r["accuracy"] is not None for r in res["rows"]] == [True]
