"""PPO's pieces against hand-worked numbers: GAE (nrl_tasks.algorithms.gae) on one sequence with
gamma 0.9 and lambda 0.8, across a gap in the response (a multi-turn observation), and the clipped
value loss (nrl_tasks.algorithms.value_loss). The figures in the comments are worked by hand."""

from __future__ import annotations

import pytest
import torch

from nrl_tasks.algorithms.gae import gae, terminal_rewards, whiten
from nrl_tasks.algorithms.value_loss import ValueLossConfig, ValueLossFn

# positions 0..4: 0 is the prompt, 1-2 the first turn, 3 an observation, 4 the second turn
MASK = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]])
VALUES = torch.tensor([[0.0, 0.5, 0.2, 9.0, 0.4]])  # V at the observation is never read


def test_the_reward_lands_on_the_last_response_token():
    r = terminal_rewards(torch.tensor([1.0]), MASK)
    assert r.tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]]
    with_kl = terminal_rewards(torch.tensor([1.0]), MASK, per_token=torch.full((1, 5), -0.1))
    assert with_kl[0].tolist() == pytest.approx([0.0, -0.1, -0.1, 0.0, 0.9])


def test_gae_equals_the_hand_worked_sequence():
    adv, ret = gae(terminal_rewards(torch.tensor([1.0]), MASK), VALUES, MASK, gamma=0.9, lam=0.8)
    # t=4: delta = 1 - 0.4 = 0.6, A = 0.6
    # t=3: skipped (observation): V_next stays 0.4, A_next stays 0.6
    # t=2: delta = 0.9 * 0.4 - 0.2 = 0.16, A = 0.16 + 0.72 * 0.6 = 0.592
    # t=1: delta = 0.9 * 0.2 - 0.5 = -0.32, A = -0.32 + 0.72 * 0.592 = 0.10624
    assert adv[0].tolist() == pytest.approx([0.0, 0.10624, 0.592, 0.0, 0.6], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.0, 0.60624, 0.792, 0.0, 1.0], abs=1e-6)  # A + V on the mask


def test_lambda_one_and_gamma_one_give_the_monte_carlo_return_minus_the_value():
    adv, ret = gae(terminal_rewards(torch.tensor([1.0]), MASK), VALUES, MASK, gamma=1.0, lam=1.0)
    assert ret[0].tolist() == pytest.approx([0.0, 1.0, 1.0, 0.0, 1.0])
    assert adv[0].tolist() == pytest.approx([0.0, 0.5, 0.8, 0.0, 0.6])


def test_a_per_sample_lambda_and_whitening():
    two = torch.cat([MASK, MASK])
    adv, _ = gae(terminal_rewards(torch.tensor([1.0, 1.0]), two), torch.cat([VALUES, VALUES]), two, 0.9,
                 torch.tensor([0.8, 0.0]))
    assert adv[0].tolist() == pytest.approx([0.0, 0.10624, 0.592, 0.0, 0.6], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([0.0, -0.32, 0.16, 0.0, 0.6], abs=1e-6)  # lambda 0: one-step TD
    w = whiten(adv, two)
    on = w[two.bool()]
    assert float(on.mean()) == pytest.approx(0.0, abs=1e-6) and float(on.var(unbiased=False)) == pytest.approx(1.0, rel=1e-4)
    assert float(w[~two.bool()].abs().sum()) == 0.0


def _value_batch() -> dict[str, torch.Tensor]:
    return {"returns": torch.tensor([[1.0, 0.0, 0.5]]), "values": torch.tensor([[0.5, 0.5, 0.5]]),
            "token_mask": torch.ones(1, 3), "sample_mask": torch.ones(1)}


def test_the_clipped_value_loss_equals_the_hand_worked_value():
    v = torch.tensor([[1.0, 0.1, 0.45]], requires_grad=True)
    loss, m = ValueLossFn(ValueLossConfig(scale=0.4, cliprange=0.2))(v, _value_batch(), 1.0, 3.0)
    # token 0: plain 0, clipped (0.7 - 1)^2 = 0.09; token 1: plain 0.01, clipped (0.3 - 0)^2 = 0.09;
    # token 2: plain = clipped = 0.0025. 0.5 * 0.4 * (0.09 + 0.09 + 0.0025) / 3
    assert loss.item() == pytest.approx(0.5 * 0.4 * 0.1825 / 3, rel=1e-6)
    assert m["vf_clipfrac"] == pytest.approx(2 / 3, rel=1e-6)
    loss.backward()
    assert v.grad[0, 0] == 0 and v.grad[0, 1] == 0  # the clipped error holds those: no gradient to v
    assert v.grad[0, 2] != 0


def test_without_clipping_it_is_half_the_scaled_mean_squared_error():
    loss, m = ValueLossFn(ValueLossConfig(scale=0.4, cliprange=None))(torch.tensor([[1.0, 0.1, 0.45]]), _value_batch(), 1.0, 3.0)
    assert loss.item() == pytest.approx(0.5 * 0.4 * (0.0 + 0.01 + 0.0025) / 3, rel=1e-6) and m["vf_clipfrac"] == 0.0
