"""Policy.score with a sequence-classification reward model (reward_model_cfg.enabled)."""

from __future__ import annotations

import uuid

import pytest
import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.models.policy.lm_policy import Policy

from .helpers import make_batch


def test_scores_match_the_hf_head(ray_session, tiny_reward_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = PolicyConfig(model_name=tiny_reward_model_dir, reward_model_cfg={"enabled": True}, num_cpus_per_worker=0.5)
    cluster = RayVirtualCluster([1], name=f"rm-{uuid.uuid4().hex[:6]}", num_cpus_per_bundle=0.5)
    policy = Policy(cluster, cfg, AutoTokenizer.from_pretrained(tiny_reward_model_dir), name_prefix="rm",
                    namespace=f"nrl-test-{uuid.uuid4().hex[:6]}", init_optimizer=False, init_reference_model=False)
    try:
        batch = make_batch(5, 16, seed=9, rl_keys=False)
        scores = policy.score(batch)["scores"]
        model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
        with torch.no_grad():
            want = torch.stack([model(batch["input_ids"][i : i + 1, :n]).logits[0, 0]
                                for i, n in enumerate(batch["input_lengths"].tolist())])
        assert scores.shape == (5,)
        torch.testing.assert_close(scores, want, rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="needs a causal LM|'generation' section"):
            policy.generate(BatchedDataDict({"input_ids": batch["input_ids"], "input_lengths": batch["input_lengths"]}))
        with pytest.raises(ValueError, match="causal LM"):
            policy.get_logprobs(batch)
    finally:
        policy.shutdown()
        cluster.shutdown()
