"""Small numerical helpers shared by the RL algorithms (NeMo-RL names and conventions).

- :func:`masked_mean`: mean over the 1-entries of a mask, optionally normalised by a *global*
  count so that micro-batch results add up to the global-batch mean.
- :func:`calculate_kl`: per-token KL estimators k1/k2/k3 (Schulman, "Approximating KL
  divergence", 2020) with NeMo-RL's input and output clamps.
- :func:`calculate_baseline_and_std_per_prompt` and :func:`compute_grpo_advantages`: the GRPO
  group baseline (leave-one-out by default, as in RLOO) and the normalised advantage.

Deviation from NeMo-RL: samples whose reward is not finite are treated as invalid (as if
their ``valid_mask`` entry were 0) instead of poisoning their group with NaN; a sample whose
float32 advantage would overflow (rewards near float32's limits) is computed in float64; and
in the leave-one-out variant the std of the other members carries the Bessel correction
(sample std of the n-1 others), which is what the worked numbers in ARCHITECTURE.md use.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "calculate_baseline_and_std_per_prompt",
    "calculate_kl",
    "compute_grpo_advantages",
    "masked_mean",
]

KLType = Literal["k1", "k2", "k3"]


def masked_mean(
    values: Tensor,
    mask: Tensor,
    dim: int | None = None,
    global_normalization_factor: Tensor | float | None = None,
) -> Tensor:
    """``sum(values * mask) / (normaliser + 1e-8)`` along ``dim`` (all dims when ``None``).

    The normaliser is ``mask.sum(dim)`` unless ``global_normalization_factor`` is given (e.g.
    the number of valid tokens of the whole global batch): then the results of the
    micro-batches of one global batch *sum* to the global mean.

    >>> masked_mean(torch.tensor([1.0, 2.0, 9.0]), torch.tensor([1, 1, 0])).item()
    1.5
    >>> round(masked_mean(torch.tensor([1.0, 2.0]), torch.ones(2), global_normalization_factor=4).item(), 6)
    0.75
    """
    if values.shape != mask.shape:
        raise ValueError(f"masked_mean: values shape {tuple(values.shape)} != mask shape {tuple(mask.shape)}")
    mask = mask.to(values.dtype)
    # where() keeps NaN/inf at masked positions out of the sum (0 * nan would be nan).
    masked = torch.where(mask != 0, values * mask, torch.zeros_like(values))
    total = masked.sum() if dim is None else masked.sum(dim=dim)
    if global_normalization_factor is None:
        normaliser = mask.sum() if dim is None else mask.sum(dim=dim)
    else:
        normaliser = global_normalization_factor
    return total / (normaliser + 1e-8)


def calculate_kl(
    logprobs: Tensor,
    logprobs_reference: Tensor,
    kl_type: KLType = "k3",
    input_clamp_value: float | None = 20.0,
    output_clamp_value: float | None = 10.0,
    importance_sampling_weights: Tensor | None = None,
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probabilities.

    With ``logr = logprobs_reference - logprobs`` (clamped to +-``input_clamp_value``):
    ``k1 = -logr``, ``k2 = logr**2 / 2``, ``k3 = exp(logr) - 1 - logr``; the result is
    clamped to +-``output_clamp_value``. Shapes are elementwise (any shape).

    ``importance_sampling_weights`` (NeMo-RL's argument): per-token weights multiplied into the
    KL *before* the output clamp (``clamp(w * kl)``). Where the input clamp applies, the weight
    is detached, so the clamp stops both the KL's and the weight's gradient. With weights
    ``exp(logprobs - logprobs.detach())`` (value 1) the gradient gains the score-function term
    ``kl * grad log pi``: the KL is estimated on samples of the policy being optimised
    (https://arxiv.org/abs/2506.09477).

    >>> lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    >>> [round(v, 4) for v in calculate_kl(lp, ref, "k3").tolist()]
    [0.1065, 0.7183]
    """
    logr = logprobs_reference - logprobs
    if input_clamp_value is not None:
        clamped = logr.clamp(min=-input_clamp_value, max=input_clamp_value)
        if importance_sampling_weights is not None:
            importance_sampling_weights = torch.where(
                logr == clamped, importance_sampling_weights, importance_sampling_weights.detach()
            )
        logr = clamped
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(f"kl_type must be one of 'k1', 'k2', 'k3', got {kl_type!r}")
    if importance_sampling_weights is not None:
        kl = importance_sampling_weights * kl
    if output_clamp_value is not None:
        kl = kl.clamp(min=-output_clamp_value, max=output_clamp_value)
    return kl


def _group_ids(prompts: Tensor) -> Tensor:
    """Group index per sample: samples with identical prompt rows share a group."""
    if prompts.ndim == 1:
        prompts = prompts.unsqueeze(-1)
    if prompts.ndim != 2:
        raise ValueError(f"prompts must be [B, P] (or [B] group ids), got shape {tuple(prompts.shape)}")
    _, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    return inverse


def calculate_baseline_and_std_per_prompt(
    prompts: Tensor,
    rewards: Tensor,
    valid_mask: Tensor,
    leave_one_out_baseline: bool = True,
) -> tuple[Tensor, Tensor]:
    """Per-sample GRPO baseline and std over the sample's group (identical prompt rows).

    Args:
        prompts: ``[B, P]`` prompt token ids (right-padded identically) or ``[B]`` group ids.
        rewards: ``[B]`` float rewards.
        valid_mask: ``[B]`` 0/1 or bool; 0 (and non-finite rewards) are left out of every
            group statistic.
        leave_one_out_baseline: RLOO baseline (https://arxiv.org/abs/2402.14740): for a valid
            member i of a group with n valid members, ``baseline_i = mean_{j != i} r_j`` and
            ``std_i`` is the sample std (Bessel, /(n-2)) of those n-1 others. Otherwise the
            group mean and the group's sample std (/(n-1)) for every member.

    Returns:
        ``(baseline, std)``, both ``[B]`` with the dtype and device of ``rewards``. Groups with
        n <= 1 valid members get ``baseline = reward`` and ``std = 0`` (zero advantage); an
        invalid sample gets the statistics of its group's valid members (its advantage is
        zeroed by :func:`compute_grpo_advantages`); a std over fewer than 2 values is 0.
    """
    baseline, std = _baseline_and_std64(prompts, rewards, valid_mask, leave_one_out_baseline)
    return baseline.to(rewards.dtype), std.to(rewards.dtype)


def _baseline_and_std64(
    prompts: Tensor, rewards: Tensor, valid_mask: Tensor, leave_one_out_baseline: bool
) -> tuple[Tensor, Tensor]:
    """:func:`calculate_baseline_and_std_per_prompt` in float64 (no float32 rounding or overflow)."""
    if rewards.ndim != 1 or valid_mask.shape != rewards.shape or prompts.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"expected prompts [B, P], rewards [B], valid_mask [B]; got {tuple(prompts.shape)}, "
            f"{tuple(rewards.shape)}, {tuple(valid_mask.shape)}"
        )
    r64 = rewards.detach().to(torch.float64)
    valid = valid_mask.to(rewards.device).bool() & torch.isfinite(r64)
    groups = _group_ids(prompts).to(rewards.device)
    baseline = torch.where(valid, r64, torch.zeros_like(r64))
    std = torch.zeros_like(r64)

    for g in groups.unique():
        members = (groups == g) & valid
        idx = members.nonzero().squeeze(-1)
        n = idx.numel()
        if n <= 1:
            continue  # baseline = own reward, std = 0: nothing to compare with
        r = r64[idx]
        if leave_one_out_baseline:
            # row i holds the n-1 rewards of the other members
            others = r.expand(n, n)[~torch.eye(n, dtype=torch.bool, device=r.device)].view(n, n - 1)
            baseline[idx] = others.mean(dim=1)
            std[idx] = others.std(dim=1, correction=1) if n > 2 else 0.0
        else:
            baseline[idx] = r.mean()
            std[idx] = r.std(correction=1)
        # invalid members of this group: compare against all valid members
        invalid = (groups == g) & ~valid
        baseline[invalid] = r.mean()
        std[invalid] = r.std(correction=1)
    return baseline, std


def compute_grpo_advantages(
    prompts: Tensor,
    rewards: Tensor,
    valid_mask: Tensor,
    *,
    leave_one_out_baseline: bool = True,
    normalize_rewards: bool = True,
    std_epsilon: float = 1e-6,
) -> Tensor:
    """GRPO advantage per sample: ``A_i = (r_i - baseline_i) / (std_i + std_epsilon)``.

    Group-relative advantage of DeepSeekMath's GRPO (https://arxiv.org/abs/2402.03300) with the
    RLOO leave-one-out baseline by default. The division happens only where ``std > 0`` (and
    only when ``normalize_rewards``), so a group whose rewards are all equal gets 0. Invalid
    samples (``valid_mask`` 0 or a non-finite reward) get exactly 0. ``std_epsilon``: NeMo-RL's 1e-6
    by default; TRL's ``GRPOTrainer`` adds 1e-4 (``grpo.adv_estimator.std_epsilon``).

    Returns ``[B]`` in ``rewards``' dtype (float32 for non-float rewards); broadcast it over
    the response tokens as ``advantages[:, None] * token_mask`` for the loss.

    >>> compute_grpo_advantages(torch.tensor([0, 0, 0, 0]), torch.tensor([1.0, 0, 0, 0]),
    ...                         torch.ones(4)).tolist()  # doctest: +ELLIPSIS
    [1.0, -0.577..., -0.577..., -0.577...]
    """
    if not rewards.is_floating_point():
        rewards = rewards.float()
    base64, std64 = _baseline_and_std64(prompts, rewards, valid_mask, leave_one_out_baseline)
    baseline, std = base64.to(rewards.dtype), std64.to(rewards.dtype)
    valid = valid_mask.to(rewards.device).bool() & torch.isfinite(rewards)
    advantages = _advantages(rewards, baseline, std, valid, normalize_rewards, std_epsilon)
    # rewards near float32's limits (say 3e38 and -3e38): ``r - baseline`` or the std overflow
    # float32 (inf, then inf/inf = NaN); those samples are computed in float64 and rounded once
    wide = valid & ~(torch.isfinite(rewards - baseline) & torch.isfinite(std))
    if bool(wide.any()):
        exact = _advantages(rewards.detach().to(torch.float64), base64, std64, valid, normalize_rewards, std_epsilon)
        advantages = torch.where(wide, exact.to(rewards.dtype), advantages)
    return advantages.detach()


def _advantages(rewards: Tensor, baseline: Tensor, std: Tensor, valid: Tensor, normalize: bool, eps: float) -> Tensor:
    advantages = torch.where(valid, rewards - baseline, torch.zeros_like(rewards))
    if normalize:
        advantages = torch.where(std > 0, advantages / (std + eps), advantages)
    return advantages
