"""GRPO baseline/advantage, masked_mean and KL estimators against ARCHITECTURE.md's numbers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nrl_tasks.algorithms.utils import (
    calculate_baseline_and_std_per_prompt,
    calculate_kl,
    compute_grpo_advantages,
    masked_mean,
)


def _prompts(*group_sizes: int, width: int = 3) -> torch.Tensor:
    """[B, width] prompt rows; group g's rows are all equal to g."""
    rows = [torch.full((width,), g) for g, n in enumerate(group_sizes) for _ in range(n)]
    return torch.stack(rows)


def test_leave_one_out_reference_numbers():
    adv = compute_grpo_advantages(_prompts(4), torch.tensor([1.0, 0, 0, 0]), torch.ones(4))
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5773, -0.5773, -0.5773]), atol=1e-4, rtol=0)


def test_group_mean_reference_numbers():
    adv = compute_grpo_advantages(
        _prompts(4), torch.tensor([1.0, 0, 0, 0]), torch.ones(4), leave_one_out_baseline=False
    )
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-4, rtol=0)


def test_two_groups_without_loo():
    adv = compute_grpo_advantages(
        _prompts(2, 2), torch.tensor([2.0, 2.0, 1.0, 3.0]), torch.ones(4), leave_one_out_baseline=False
    )
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, -0.7071, 0.7071]), atol=1e-4, rtol=0)


def test_groups_are_identical_rows_in_any_order():
    prompts = torch.tensor([[5, 1], [7, 0], [5, 1], [7, 0]])  # interleaved groups
    rewards = torch.tensor([1.0, 1.0, 3.0, 2.0])
    baseline, std = calculate_baseline_and_std_per_prompt(prompts, rewards, torch.ones(4), False)
    torch.testing.assert_close(baseline, torch.tensor([2.0, 1.5, 2.0, 1.5]))
    torch.testing.assert_close(std, torch.tensor([math.sqrt(2), math.sqrt(0.5), math.sqrt(2), math.sqrt(0.5)]))


def test_loo_baseline_is_mean_of_others_with_bessel_std():
    rewards = torch.tensor([0.0, 1.0, 2.0, 4.0])
    baseline, std = calculate_baseline_and_std_per_prompt(_prompts(4), rewards, torch.ones(4))
    for i in range(4):
        others = torch.cat([rewards[:i], rewards[i + 1 :]])
        assert baseline[i].item() == pytest.approx(others.mean().item())
        assert std[i].item() == pytest.approx(others.std(correction=1).item(), rel=1e-6)


def test_singletons_and_constant_groups_get_zero():
    prompts = _prompts(1, 3, 2)
    rewards = torch.tensor([5.0, 0.3, 0.3, 0.3, 1.0, 0.0])
    adv = compute_grpo_advantages(prompts, rewards, torch.ones(6))
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    # a pair under LOO: baseline is the other reward, std over one value is 0 -> no division
    torch.testing.assert_close(adv[4:], torch.tensor([1.0, -1.0]))


def test_masked_and_nan_rewards_are_left_out_and_get_zero():
    rewards = torch.tensor([1.0, 0.0, float("nan"), 0.0, 0.0, 123.0])
    valid = torch.tensor([1, 1, 1, 1, 1, 0])  # index 2: NaN, index 5: masked
    adv = compute_grpo_advantages(_prompts(6), rewards, valid)
    assert torch.isfinite(adv).all()
    assert adv[2].item() == 0.0 and adv[5].item() == 0.0
    # the four valid rewards behave exactly like the [1, 0, 0, 0] reference group
    torch.testing.assert_close(adv[[0, 1, 3, 4]], torch.tensor([1.0, -0.5773, -0.5773, -0.5773]), atol=1e-4, rtol=0)


def test_no_normalisation_gives_raw_differences():
    adv = compute_grpo_advantages(
        _prompts(4), torch.tensor([1.0, 0, 0, 0]), torch.ones(4), normalize_rewards=False
    )
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_one_dim_group_ids_and_bad_shapes():
    adv = compute_grpo_advantages(torch.tensor([3, 3, 3, 3]), torch.tensor([1, 0, 0, 0]), torch.ones(4))
    assert adv.dtype == torch.float32
    assert adv[0].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rewards"):
        compute_grpo_advantages(_prompts(4), torch.ones(3), torch.ones(4))


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=12),
    st.lists(st.floats(-5, 5, allow_nan=False), min_size=12, max_size=12),
    st.lists(st.booleans(), min_size=12, max_size=12),
    st.booleans(),
)
def test_advantages_match_a_naive_per_group_loop(groups, rewards, valid, loo):
    b = len(groups)
    prompts = torch.tensor(groups)
    r = torch.tensor(rewards[:b], dtype=torch.float64)
    v = torch.tensor(valid[:b])
    adv = compute_grpo_advantages(prompts, r, v, leave_one_out_baseline=loo)
    for i in range(b):
        mates = [j for j in range(b) if groups[j] == groups[i] and valid[j]]
        if not valid[i] or len(mates) <= 1:
            assert adv[i].item() == 0.0
            continue
        pool = [rewards[j] for j in mates if j != i] if loo else [rewards[j] for j in mates]
        base = sum(pool) / len(pool)
        var = sum((x - base) ** 2 for x in pool) / (len(pool) - 1) if len(pool) > 1 else 0.0
        std = math.sqrt(var)
        expected = (rewards[i] - base) / (std + 1e-6) if std > 0 else rewards[i] - base
        assert adv[i].item() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_masked_mean_global_normalisation_sums_over_microbatches():
    torch.manual_seed(0)
    values, mask = torch.randn(8, 5), (torch.rand(8, 5) > 0.3).float()
    full = masked_mean(values, mask)
    parts = sum(masked_mean(values[i : i + 2], mask[i : i + 2], global_normalization_factor=mask.sum()) for i in range(0, 8, 2))
    torch.testing.assert_close(parts, full)
    per_row = masked_mean(values, mask, dim=-1)
    assert per_row.shape == (8,)
    with pytest.raises(ValueError, match="shape"):
        masked_mean(values, mask[:, :2])


def test_masked_mean_ignores_nan_at_masked_positions():
    assert masked_mean(torch.tensor([2.0, float("nan")]), torch.tensor([1.0, 0.0])).item() == pytest.approx(2.0)


def test_kl_estimators_reference_numbers():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(calculate_kl(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(calculate_kl(logp, ref, "k2"), torch.tensor([0.125, 0.5]))
    torch.testing.assert_close(calculate_kl(logp, ref, "k3"), torch.tensor([0.1065, 0.7183]), atol=1e-4, rtol=0)


def test_kl_clamps():
    logp, ref = torch.tensor([0.0, 0.0]), torch.tensor([-50.0, 50.0])
    # input clamp: logr in [-20, 20]; output clamp: kl in [-10, 10]
    torch.testing.assert_close(calculate_kl(logp, ref, "k1", 20.0, None), torch.tensor([20.0, -20.0]))
    torch.testing.assert_close(calculate_kl(logp, ref, "k1", 20.0, 10.0), torch.tensor([10.0, -10.0]))
    assert torch.isfinite(calculate_kl(logp, ref, "k3", 20.0, 10.0)).all()
    with pytest.raises(ValueError, match="kl_type"):
        calculate_kl(logp, ref, "k4")  # type: ignore[arg-type]
