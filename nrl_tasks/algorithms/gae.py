"""Generalised advantage estimation (Schulman et al., https://arxiv.org/abs/1506.02438) for PPO with a
value model (NeMo-RL's ``ppo.adv_estimator: {name: gae, gae_lambda, gae_gamma, normalize_advantages}``).

A sampled sequence's tokens are the actions; ``mask`` marks the response tokens the policy
produced (``token_mask``, position ``t`` holding token ``t``). The task's reward ``R`` is given at
the last response token; with ``loss_fn.use_kl_in_reward`` each response token also gets
``-beta * KL_t`` (the reference KL of its logprob). With values ``V_t`` of the state before
token ``t`` (the value model's head one position back)::

    delta_t = r_t + gamma * V_next(t) - V_t
    A_t     = delta_t + gamma * lambda * A_next(t)          (0 after the last response token)
    R_t     = A_t + V_t                                      (the value model's target, "returns")

where ``next(t)`` is the next *response* token after ``t``: positions outside the mask (an
environment's observation between two turns, padding) are skipped, carrying ``V`` and ``A`` over
them. ``normalize_advantages`` whitens ``A`` over the masked tokens of the batch (mean 0,
variance 1); advantages outside the mask are 0.

NeMo-RL's VAPO keys: ``gae_lambda_value`` (the lambda of the returns) and ``gae_lambda_policy`` or
``length_adaptive_alpha`` (the lambda of the advantages: ``1 - 1 / (alpha * response length)``
per sample) decouple the two; unset, both use ``gae_lambda``. No deviations from NeMo-RL's figures.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gae", "terminal_rewards", "whiten"]


def terminal_rewards(rewards: Tensor, mask: Tensor, per_token: Tensor | None = None) -> Tensor:
    """``[B, S]`` token rewards: ``per_token`` (e.g. ``-beta * KL``; default 0) on the masked tokens,
    plus each row's ``rewards [B]`` at its last masked token (a row without one gets none)."""
    m = mask.to(torch.float32)
    out = torch.zeros_like(m) if per_token is None else per_token.to(torch.float32) * m
    width = m.shape[1]
    last = width - 1 - m.flip(1).argmax(dim=1)
    has = m.any(dim=1) if m.dtype == torch.bool else m.sum(dim=1) > 0
    rows = torch.nonzero(has).squeeze(1)
    out[rows, last[rows]] += rewards.to(torch.float32)[rows]
    return out


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float | Tensor) -> tuple[Tensor, Tensor]:
    """``(advantages, returns)`` ``[B, S]`` of the module docstring; ``lam`` a float or ``[B]``."""
    m = mask.to(torch.float32)
    r, v = token_rewards.to(torch.float32), values.to(torch.float32)
    lam_t = torch.as_tensor(lam, dtype=torch.float32).expand(r.shape[0]) if not isinstance(lam, Tensor) else lam.float()
    next_value = torch.zeros(r.shape[0])
    running = torch.zeros(r.shape[0])
    out = torch.zeros_like(r)
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        here = delta + gamma * lam_t * running
        mt = m[:, t]
        next_value = mt * v[:, t] + (1 - mt) * next_value
        running = mt * here + (1 - mt) * running
        out[:, t] = running
    return out * m, (out + v) * m


def whiten(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with mean 0 and variance 1 over the masked entries (0 elsewhere)."""
    m = mask.to(torch.float32)
    n = m.sum().clamp(min=1.0)
    mean = (x * m).sum() / n
    var = (((x - mean) ** 2) * m).sum() / n
    return (x - mean) * torch.rsqrt(var + 1e-8) * m
