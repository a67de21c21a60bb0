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


def test_a_causal_lm_trains_as_a_reward_model_and_saves_a_classifier(ray_session, tiny_model_dir, tmp_path):
    """``nrl rm``'s policy: a causal LM's folder loaded with a new one-output head, trained with the
    Bradley-Terry loss (the chosen rows' scores rise above the rejected ones'), saved as a
    ``*ForSequenceClassification`` model that scores like the live policy."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from nrl_tasks.algorithms.reward_model import BradleyTerryLossFn
    from nrl_tasks.config.data import DataConfig
    from nrl_tasks.stages.preferences import build_pair_batch, builtin_preferences

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = PolicyConfig(model_name=tiny_model_dir, reward_model_cfg={"enabled": True}, num_cpus_per_worker=0.5,
                       train_global_batch_size=16, train_micro_batch_size=8, max_total_sequence_length=64,
                       optimizer={"kwargs": {"lr": 1e-3, "weight_decay": 0.0}})
    cluster = RayVirtualCluster([1], name=f"rmt-{uuid.uuid4().hex[:6]}", num_cpus_per_bundle=0.5)
    policy = Policy(cluster, cfg, tok, name_prefix="rmt", namespace=f"nrl-test-{uuid.uuid4().hex[:6]}",
                    init_reference_model=False)
    try:
        data = DataConfig(dataset="arithmetic", arithmetic={"num_train": 8, "num_val": 4, "max_operand": 9})
        recs = builtin_preferences(data, seed=3)
        b = build_pair_batch(recs, list(range(8)), tok, data, 64)
        batch = BatchedDataDict({k: b[k] for k in ("input_ids", "input_lengths", "token_mask", "sample_mask")})
        before = policy.score(batch)["scores"]
        losses = [float(policy.train(batch, BradleyTerryLossFn())["loss"]) for _ in range(6)]
        assert losses[-1] < losses[0], losses
        scores = policy.score(batch)["scores"]
        margin = lambda s: float((s[0::2] - s[1::2]).mean())  # noqa: E731  chosen minus rejected
        assert margin(scores) > margin(before) + 0.5, (margin(before), margin(scores))
        assert (scores[0::2] > scores[1::2]).float().mean() >= 0.75  # the trained pairs, mostly chosen above rejected
        with pytest.raises(ValueError, match="reads token logprobs, but this policy is a reward model"):
            from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn

            policy.train(batch, ClippedPGLossFn({}))
        weights = str(tmp_path / "weights")
        policy.save_checkpoint(weights)
        assert AutoConfig.from_pretrained(weights).architectures == ["LlamaForSequenceClassification"]
        saved = AutoModelForSequenceClassification.from_pretrained(weights).eval()
        assert saved.config.num_labels == 1
        with torch.no_grad():
            want = torch.stack([saved(batch["input_ids"][i : i + 1, :n]).logits[0, 0]
                                for i, n in enumerate(batch["input_lengths"].tolist())])
        torch.testing.assert_close(scores, want, rtol=0, atol=1e-5)
    finally:
        policy.shutdown()
        cluster.shutdown()
