"""REINFORCE++ advantages and the ``advantages`` stage's estimator choice, against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from nrl_tasks.algorithms.advantage_estimators import reinforce_plus_plus_advantages


def _normalised(values: list[float]) -> list[float]:
    mu = sum(values) / len(values)
    sd = math.sqrt(sum((v - mu) ** 2 for v in values) / len(values))
    return [(v - mu) / sd for v in values]


def test_reinforce_plus_plus_minus_baseline_then_token_normalisation():
    """Two groups of 2; rewards [1, 0 | 1, 1]: group means 0.5 and 1 -> a = [.5, -.5, 0, 0];
    tokens per sample [2, 1, 1, 2]; normalised over the 6 valid tokens."""
    token_mask = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 0], [0, 1, 1]])
    adv = reinforce_plus_plus_advantages(torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.ones(4), token_mask)
    tokens = [0.5, 0.5, -0.5, 0.0, 0.0, 0.0]
    want = _normalised(tokens)
    got = [adv[0, 1], adv[0, 2], adv[1, 1], adv[2, 1], adv[3, 1], adv[3, 2]]
    assert [float(g) for g in got] == pytest.approx(want, rel=1e-5)
    assert float(adv[1, 2]) == 0.0 and float(adv[0, 0]) == 0.0  # padding and prompt


def test_reinforce_plus_plus_without_baseline_and_with_kl_in_the_reward():
    token_mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    kl = torch.tensor([[0.0, 0.2, 0.4], [0.0, 0.0, 0.6]])
    adv = reinforce_plus_plus_advantages(torch.tensor([0, 0]), torch.tensor([1.0, 0.0]), torch.ones(2), token_mask,
                                         minus_baseline=False, kl_penalty=kl)
    want = _normalised([1.0 - 0.2, 1.0 - 0.4, 0.0 - 0.0, 0.0 - 0.6])
    assert adv[:, 1:].flatten().tolist() == pytest.approx(want, rel=1e-5)


def test_reinforce_plus_plus_invalid_samples_get_zero_and_no_vote():
    token_mask = torch.tensor([[0, 1], [0, 1], [0, 1]])
    adv = reinforce_plus_plus_advantages(torch.tensor([0, 0, 0]), torch.tensor([1.0, 0.0, float("nan")]),
                                         torch.tensor([1.0, 1.0, 1.0]), token_mask)
    assert adv[2].tolist() == [0.0, 0.0]
    assert adv[:2, 1].tolist() == pytest.approx([1.0, -1.0], rel=1e-5)  # mean 0.5 of the valid two


def test_stage_function_picks_the_estimator_and_adds_rewards_for_vapo():
    from flows.config import load_config
    from nrl_tasks.stages.advantages import compute_advantages

    base = "configs/grpo_tiny.yaml"
    groups, r, valid = torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.ones(4, dtype=torch.bool)
    tm = torch.tensor([[0, 1, 1]] * 4)
    grpo = load_config(base)
    out = compute_advantages(groups, r, valid, grpo.grpo, loss_cfg=grpo.loss_fn, token_mask=tm)
    assert out["advantages"].shape == (4,) and "rewards" not in out
    rpp = load_config(base, ["grpo.adv_estimator.name=reinforce_plus_plus", "loss_fn.use_kl_in_reward=true",
                             "loss_fn.positive_example_nll_weight=0.1"])
    lp = {"prev_logprobs": torch.full((4, 3), -1.0), "reference_policy_logprobs": torch.full((4, 3), -1.0)}
    out = compute_advantages(groups, r, valid, rpp.grpo, loss_cfg=rpp.loss_fn, token_mask=tm, logprobs=lp)
    assert out["advantages"].shape == (4, 3) and out["rewards"].tolist() == [1.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="use_kl_in_reward needs the step's logprobs"):
        compute_advantages(groups, r, valid, rpp.grpo, loss_cfg=rpp.loss_fn, token_mask=tm)


def test_train_data_takes_per_sample_or_per_token_advantages():
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
    from nrl_tasks.stages.train import build_train_data

    tm = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    rollouts = BatchedDataDict({"input_ids": torch.zeros(2, 3, dtype=torch.long), "input_lengths": torch.tensor([3, 2]),
                                "token_mask": tm, "generation_logprobs": torch.zeros(2, 3)})
    lp = BatchedDataDict({"prev_logprobs": torch.zeros(2, 3), "reference_policy_logprobs": torch.zeros(2, 3)})
    per_sample = build_train_data(rollouts, lp, BatchedDataDict({"advantages": torch.tensor([2.0, -1.0]), "sample_mask": torch.ones(2)}))
    assert per_sample["advantages"].tolist() == [[0.0, 2.0, 2.0], [0.0, -1.0, 0.0]]
    per_token = build_train_data(rollouts, lp, BatchedDataDict({"advantages": torch.tensor([[9.0, 1.0, 2.0], [9.0, 3.0, 9.0]]),
                                                                "sample_mask": torch.ones(2), "rewards": torch.tensor([1.0, 0.0])}))
    assert per_token["advantages"].tolist() == [[0.0, 1.0, 2.0], [0.0, 3.0, 0.0]] and per_token["rewards"].tolist() == [1.0, 0.0]
