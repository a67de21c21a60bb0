"""The Bradley-Terry loss of reward-model training (``nrl rm``) against values worked by hand on a
fixed batch, and its split into micro-batches summing to the global batch's loss."""

from __future__ import annotations

import math

import pytest
import torch

from nrl_tasks.algorithms.reward_model import BradleyTerryLossFn

# three pairs (chosen, rejected) interleaved; the third pair masked out
SCORES = torch.tensor([2.0, 0.5, -1.0, 1.0, 3.0, -3.0])
MASK = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])


def _softplus(x: float) -> float:  # -log sigmoid(m) = log(1 + exp(-m))
    return math.log1p(math.exp(-x))


def test_the_loss_and_metrics_equal_the_hand_computed_values():
    loss, m = BradleyTerryLossFn()(SCORES, {"sample_mask": MASK}, global_valid_seqs=torch.tensor(4.0), global_valid_toks=None)
    margins = [2.0 - 0.5, -1.0 - 1.0]  # the two valid pairs
    want = (_softplus(margins[0]) + _softplus(margins[1])) / 2  # = (0.20141327 + 2.12692801) / 2
    assert loss.item() == pytest.approx(want, rel=1e-6) and want == pytest.approx(1.16417064, rel=1e-6)
    assert m["accuracy"] == 0.5 and m["num_valid_samples"] == 2.0
    assert m["rewards_chosen_mean"] == pytest.approx(0.5) and m["rewards_rejected_mean"] == pytest.approx(0.75)
    assert m["rewards_margin_mean"] == pytest.approx(-0.25)


def test_micro_batch_losses_sum_to_the_global_batch_loss_and_gradients_point_up_for_chosen():
    scores = SCORES.clone().requires_grad_(True)
    whole, _ = BradleyTerryLossFn()(scores, {"sample_mask": MASK}, torch.tensor(4.0), None)
    parts = sum(BradleyTerryLossFn()(scores[i:i + 2], {"sample_mask": MASK[i:i + 2]}, torch.tensor(4.0), None)[0]
                for i in (0, 2, 4))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
    whole.backward()
    g = scores.grad
    assert g[0] < 0 < g[1] and g[2] < 0 < g[3]  # descent raises chosen, lowers rejected
    assert g[4] == 0 and g[5] == 0  # the masked pair adds nothing


def test_an_odd_row_count_is_refused():
    with pytest.raises(ValueError, match="pairs on adjacent rows"):
        BradleyTerryLossFn()(torch.zeros(3), {"sample_mask": torch.ones(3)}, None, None)
