"""A real Policy trains one step, then refits HfGeneration workers with the contract's sequence.

After the refit the generation workers hold bit-identical weights (checksum) and the Policy's
new version; a stale version is refused; and the logprobs the workers report for their samples
equal ``Policy.get_logprobs`` of the same sequences (same temperature convention).
"""

from __future__ import annotations

import uuid

import pytest
import torch

from nrl_tasks.models.generation.hf_generation import HfGeneration
from nrl_tasks.models.generation.interfaces import GenerationConfig, StaleWeightsError

from ._tiny_lm import encode_batch

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["What is 3 + 4?", "Hello!", "The answer is", "One, two, three"]


def policy_and_generation(tiny_model_dir, name: str, **generation):
    """A one-rank ``Policy`` (lr 1e-2, no reference model) and a one-worker ``HfGeneration`` of the
    tiny model in a fresh namespace (``generation``: config overrides); yields ``(policy, gen,
    tokenizer)`` and removes everything after."""
    from transformers import AutoTokenizer

    from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
    from nrl_tasks.models.policy import PolicyConfig
    from nrl_tasks.models.policy.lm_policy import Policy

    tag = uuid.uuid4().hex[:8]
    namespace = f"nrl-{name}-{tag}"
    gen_cfg = GenerationConfig(**{"model_name": tiny_model_dir, "max_new_tokens": 8, "temperature": 0.8, "num_workers": 1,
                                  "num_cpus_per_worker": 0.5, "refit_timeout_s": 60, **generation})
    pcfg = PolicyConfig(
        model_name=tiny_model_dir, train_global_batch_size=4, train_micro_batch_size=2,
        max_total_sequence_length=64, generation=gen_cfg, optimizer={"kwargs": {"lr": 1e-2}},
    )
    policy_cluster = RayVirtualCluster([1], name=f"pol-{tag}", num_cpus_per_bundle=1)
    gen_cluster = RayVirtualCluster([1], name=f"gen-{tag}", num_cpus_per_bundle=0.5)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = Policy(policy_cluster, pcfg, tokenizer, namespace=namespace, init_reference_model=False)
    gen = HfGeneration(gen_cluster, gen_cfg, namespace=namespace)
    yield policy, gen, tokenizer
    gen.shutdown()
    policy.shutdown()
    gen_cluster.shutdown()
    policy_cluster.shutdown()


@pytest.fixture(scope="module")
def policy_and_gen(ray_session, tiny_model_dir):
    yield from policy_and_generation(tiny_model_dir, "refit")


def _prompts(tokenizer):
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

    ids, lengths = encode_batch(tokenizer, PROMPTS)
    return BatchedDataDict({"input_ids": ids, "input_lengths": lengths, "seeds": torch.arange(len(PROMPTS)) + 11})


def _train_batch(out):
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

    ids, total = out["output_ids"], out["unpadded_sequence_lengths"]
    token_mask = torch.zeros_like(ids, dtype=torch.float32)
    for i in range(ids.shape[0]):
        token_mask[i, int(total[i] - out["generation_lengths"][i]) : int(total[i])] = 1.0
    return BatchedDataDict({"input_ids": ids, "input_lengths": total, "token_mask": token_mask,
                            "sample_mask": torch.ones(ids.shape[0])})


def test_train_then_refit_gives_identical_weights_and_version(policy_and_gen):
    import ray

    from nrl_tasks.algorithms.loss_functions import NLLLossFn
    from nrl_tasks.utils.collective import find_free_port, get_node_ip

    policy, gen, tokenizer = policy_and_gen
    prompts = _prompts(tokenizer)
    assert gen.weights_version == policy.weights_version == 0
    assert gen.weights_checksum() == policy.weights_checksum()

    rollout = gen.generate(prompts, weights_version=0)
    metrics = policy.train(_train_batch(rollout), NLLLossFn())
    assert metrics["weights_version"] == policy.weights_version == 1
    assert gen.weights_checksum() != policy.weights_checksum()
    with pytest.raises(StaleWeightsError, match="holds weights version 0, asked for version 1"):
        gen.generate(prompts, weights_version=1)

    # the refit sequence of the contract (what the refit stage runs)
    info = policy.prepare_refit_info()
    gen.prepare_refit_info(info)
    ip, port = get_node_ip(), find_free_port()
    world = 1 + gen.refit_world_size
    ray.get(policy.init_collective(ip, port, world, train_world_size=1)
            + gen.init_collective(ip, port, world, rank_offset=1), timeout=120)
    ray.get(policy.broadcast_weights_for_collective()
            + gen.update_weights_from_collective(policy.weights_version), timeout=120)

    assert gen.weights_version == 1
    assert gen.weights_checksum() == policy.weights_checksum()
    with pytest.raises(StaleWeightsError):
        gen.generate(prompts, weights_version=0)
    out = gen.generate(prompts, weights_version=1)

    # the generation logprobs are the ones the policy computes for the same tokens
    lp = policy.get_logprobs(out.__class__({"input_ids": out["output_ids"], "input_lengths": out["unpadded_sequence_lengths"]}))["logprobs"]
    mask = out["logprobs"] != 0
    assert mask.any()
    torch.testing.assert_close(lp[mask], out["logprobs"][mask], atol=1e-4, rtol=1e-4)
