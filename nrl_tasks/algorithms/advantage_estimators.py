"""REINFORCE++ advantages (``grpo.adv_estimator.name: reinforce_plus_plus``; GRPO's estimator is
:func:`nrl_tasks.algorithms.utils.compute_grpo_advantages`).

REINFORCE++ (Hu et al., https://arxiv.org/abs/2501.03262), NeMo-RL's variant: per sample ``i`` of
prompt group ``g`` and response token ``t``::

    a_i   = r_i - mean_{j in g} r_j            (minus_baseline; else a_i = r_i)
    A_i,t = a_i - beta * KL_t                  (loss_fn.use_kl_in_reward: k1/k2/k3 of pi_old vs pi_ref)
    A     = (A - mean(A)) / std(A)             (over every valid token of the batch)

Invalid samples (``valid`` 0 or a non-finite reward) are left out of the group mean and the
normalisation and get advantage 0. The KL uses the run's ``reference_policy_kl_type`` with
NeMo-RL's default clamps (input 20, output 10); it carries no gradient (a reward).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nrl_tasks.algorithms.utils import calculate_baseline_and_std_per_prompt

__all__ = ["reinforce_plus_plus_advantages"]


def reinforce_plus_plus_advantages(
    group_id: Tensor,
    rewards: Tensor,
    valid: Tensor,
    token_mask: Tensor,
    *,
    minus_baseline: bool = True,
    kl_penalty: Tensor | None = None,
) -> Tensor:
    """``[B, S]`` float32 advantages (0 outside ``token_mask`` and on invalid samples).

    ``kl_penalty``: ``[B, S]`` ``beta * KL_t`` to subtract from each token's reward, or ``None``.

    >>> reinforce_plus_plus_advantages(torch.tensor([0, 0]), torch.tensor([1.0, 0.0]), torch.ones(2),
    ...                                torch.tensor([[0, 1], [0, 1]])).tolist()
    [[0.0, 1.0], [0.0, -1.0]]
    """
    r = rewards.detach().to(torch.float64)
    ok = valid.bool() & torch.isfinite(r)
    if minus_baseline:
        mean, _ = calculate_baseline_and_std_per_prompt(group_id, r, ok.double(), leave_one_out_baseline=False)
        r = r - mean
    mask = token_mask.to(torch.float64) * ok.double().unsqueeze(-1)
    adv = torch.where(ok, r, torch.zeros_like(r)).unsqueeze(-1) * mask
    if kl_penalty is not None:
        adv = adv - kl_penalty.detach().to(torch.float64) * mask
    n = mask.sum()
    if n > 0:
        mu = (adv * mask).sum() / n
        var = ((adv - mu).square() * mask).sum() / n
        adv = (adv - mu) * var.clamp(min=1e-8).rsqrt()
    return torch.where(mask > 0, adv, torch.zeros_like(adv)).to(torch.float32)
