"""The DPO loss against numbers worked out by hand (Rafailov et al. 2023, eq. 7)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from nrl_tasks.algorithms.dpo import DPOLossConfig, DPOLossFn


def _pair():
    """One pair: chosen tokens lp [-1, -2] (ref [-1.5, -2.5]), rejected token lp [-3] (ref [-2])."""
    data = {
        "token_mask": torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]),
        "sample_mask": torch.ones(2),
        "reference_policy_logprobs": torch.tensor([[0.0, -1.5, -2.5], [0.0, -2.0, 0.0]]),
    }
    curr = torch.tensor([[-1.0, -2.0], [-3.0, 0.0]], requires_grad=True)
    return curr, data


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_preference_loss_value_gradient_and_metrics():
    curr, data = _pair()
    loss, m = DPOLossFn({"reference_policy_kl_penalty": 0.1})(curr, data, 2.0, None)
    # r(chosen) = 0.1 * (0.5 + 0.5) = 0.1, r(rejected) = 0.1 * (-1) = -0.1, margin 0.2
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.2)), rel=1e-6)
    loss.backward()
    g = (1 - sigmoid(0.2)) * 0.1  # d(-log sigmoid(m))/dm = -(1 - sigmoid(m)); dm/dlp = +-beta
    assert curr.grad[0].tolist() == pytest.approx([-g, -g], rel=1e-5)
    assert curr.grad[1].tolist() == pytest.approx([g, 0.0], rel=1e-5)
    assert m["accuracy"] == 1.0 and m["rewards_margin_mean"] == pytest.approx(0.2, rel=1e-5)
    assert m["rewards_chosen_mean"] == pytest.approx(0.1, rel=1e-5) and m["num_valid_samples"] == 1.0


def test_sft_term_and_averaging():
    curr, data = _pair()
    loss, m = DPOLossFn({"reference_policy_kl_penalty": 0.1, "sft_loss_weight": 0.5})(curr, data, 2.0, None)
    assert m["sft_loss"] == pytest.approx(3.0) and loss.item() == pytest.approx(math.log(1 + math.exp(-0.2)) + 1.5, rel=1e-6)
    curr, data = _pair()
    _, m = DPOLossFn({"reference_policy_kl_penalty": 0.1, "sft_loss_weight": 0.5, "sft_average_log_probs": True,
                      "preference_average_log_probs": True})(curr, data, 2.0, None)
    assert m["sft_loss"] == pytest.approx(1.5)
    # averaged: r(chosen) = 0.1 * 0.5, r(rejected) = 0.1 * -1
    assert m["rewards_margin_mean"] == pytest.approx(0.15, rel=1e-5)


def test_micro_batches_sum_to_the_global_mean():
    curr, data = _pair()
    whole, _ = DPOLossFn()(torch.cat([curr, curr]).detach(), {k: torch.cat([v, v]) for k, v in data.items()}, 4.0, None)
    half, _ = DPOLossFn()(curr.detach(), data, 4.0, None)  # one of two micro-batches of the global batch
    assert (2 * half).item() == pytest.approx(whole.item(), rel=1e-6)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="pairs on adjacent rows: got 3 rows"):
        DPOLossFn()(torch.zeros(3, 2), {"token_mask": torch.ones(3, 3), "sample_mask": torch.ones(3),
                                        "reference_policy_logprobs": torch.zeros(3, 3)}, None, None)
    with pytest.raises(ValidationError, match="reference_policy_kl_penalty"):
        DPOLossConfig(reference_policy_kl_penalty=0.0)
    with pytest.raises(ValidationError, match="beta"):
        DPOLossConfig(beta=0.1)
