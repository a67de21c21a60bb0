"""Colocated generation: a real Policy samples on its live weights through ``ColocatedGeneration``.

The samples equal those of a separate HF generation worker holding the same weights (same rows,
same seeds: one sampling call); after ``train`` the colocated side refuses to sample until the
refit stage's ``refit_weights`` recorded the new version (no bytes move), and then samples on the
trained weights, again equal to a worker refitted over the packed broadcast.
"""

from __future__ import annotations

import pytest
import torch

from nrl_tasks.models.generation.colocated import ColocatedGeneration
from nrl_tasks.models.generation.interfaces import StaleWeightsError

from ._tiny_lm import encode_batch
from .test_policy_refit import PROMPTS, _train_batch, policy_and_generation

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def policy_and_gen(ray_session, tiny_model_dir):
    yield from policy_and_generation(tiny_model_dir, "colo", stop_strings=["!"])


def _prompts(tokenizer):
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

    ids, lengths = encode_batch(tokenizer, PROMPTS)
    return BatchedDataDict({
        "input_ids": ids, "input_lengths": lengths, "seeds": torch.arange(len(PROMPTS)) + 5,
        "stop_strings": [None, ["?"], None, [","]],  # per-row stops merge with the configured "!"
    })


def _assert_same_samples(a, b):
    for key in ("output_ids", "generation_lengths", "unpadded_sequence_lengths", "truncated"):
        assert torch.equal(a[key], b[key]), key
    torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-5, rtol=1e-5)


def test_colocated_samples_like_a_worker_and_refits_by_version(policy_and_gen):
    from nrl_tasks.algorithms.loss_functions import NLLLossFn
    from nrl_tasks.stages.health import generation_responsive
    from nrl_tasks.stages.refit import refit_weights

    policy, gen, tokenizer = policy_and_gen
    colo = ColocatedGeneration(policy)
    prompts = _prompts(tokenizer)
    assert colo.weights_version == 0 and colo.refit_world_size == 0
    assert colo.workers == list(policy.worker_group.workers)
    _assert_same_samples(colo.generate(prompts, weights_version=0), gen.generate(prompts, weights_version=0))

    rollout = colo.generate(prompts, weights_version=0)
    policy.train(_train_batch(rollout), NLLLossFn())
    assert policy.weights_version == 1
    with pytest.raises(StaleWeightsError, match="live weights are version 1"):
        colo.generate(prompts, weights_version=0)  # trained since: no sampling on the old version's name
    with pytest.raises(StaleWeightsError, match="serves weights version 0, asked for version 1"):
        colo.generate(prompts, weights_version=1)

    out = refit_weights(policy, colo, 1, timeout_s=30, verify_checksum=True)
    assert out["colocated"] is True and out["bytes"] == 0 and out["weights_version"] == 1
    assert colo.weights_version == 1 and generation_responsive(colo) == [{"weights_version": 1, "stale": False, "rank": 0}]
    full = refit_weights(policy, gen, 1, timeout_s=60, verify_checksum=True)
    assert full["bytes"] > 0
    _assert_same_samples(colo.generate(prompts, weights_version=1), gen.generate(prompts, weights_version=1))

    colo.mark_stale()
    assert colo.weights_version is None
    with pytest.raises(StaleWeightsError, match="stale"):
        colo.generate(prompts, weights_version=1)
    with pytest.raises(StaleWeightsError, match="the policy holds 1"):
        refit_weights(policy, colo, 2, timeout_s=30)
    assert colo.weights_version is None  # a failed refit leaves it refusing
