"""Diagnostics of a policy-gradient step (NeMo-RL's metric names; no gradient).

Generator/trainer mismatch, from ``prev`` (log pi_old, the trainer's) and ``gen`` (log pi_gen,
the sampler's) on the sampled tokens, token-level, normalised by the global valid-token count:

- ``token_mult_prob_error = mean_t exp(|gen_t - prev_t|)`` (1 when they agree);
- ``gen_kl_error``: KL(pi_gen || pi_old) and ``policy_kl_error``: KL(pi_old || pi_gen), estimated
  with the run's ``reference_policy_kl_type`` on the sampled tokens, without clamps;
- ``js_divergence_error``: Jensen-Shannon, ``0.5 KL(P_old || M) + 0.5 KL(P_gen || M)`` with
  ``M = (p_old + p_gen) / 2`` per token, each KL by the k3 form ``exp(x) - x - 1``.

Ratio extrema ``probs_ratio_min/max`` and ``probs_ratio_clamped_min/max`` over the valid tokens of
the micro-batch (combined over micro-batches by min/max; ``inf``/``-inf`` when it has none).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nrl_tasks.algorithms.utils import calculate_kl, masked_mean

__all__ = ["mismatch_metrics", "ratio_extrema"]


def mismatch_metrics(prev: Tensor, gen: Tensor, mask: Tensor, kl_type: str, global_valid_toks: Tensor | float | None) -> dict[str, float]:
    """The generator/trainer mismatch figures (see the module docstring)."""
    with torch.no_grad():
        mean = lambda x: float(masked_mean(x, mask, global_normalization_factor=global_valid_toks))  # noqa: E731
        log_m = torch.log(0.5 * torch.exp(prev) + 0.5 * torch.exp(gen))
        k3 = lambda x: torch.exp(x) - x - 1  # noqa: E731
        return {
            "token_mult_prob_error": mean(torch.exp((gen - prev).abs() * mask)),
            "gen_kl_error": mean(calculate_kl(gen, prev, kl_type, None, None)),
            "policy_kl_error": mean(calculate_kl(prev, gen, kl_type, None, None)),
            "js_divergence_error": mean(0.5 * k3(prev - log_m) + 0.5 * k3(gen - log_m)),
        }


def ratio_extrema(ratios: Tensor, clamped: Tensor, mask: Tensor) -> dict[str, float]:
    """Min and max of the ratios and clamped ratios over ``mask``."""
    keep = mask > 0
    if not bool(keep.any()):
        inf = float("inf")
        return {"probs_ratio_min": inf, "probs_ratio_max": -inf, "probs_ratio_clamped_min": inf, "probs_ratio_clamped_max": -inf}
    r, c = ratios.detach()[keep], clamped.detach()[keep]
    return {
        "probs_ratio_min": float(r.min()), "probs_ratio_max": float(r.max()),
        "probs_ratio_clamped_min": float(c.min()), "probs_ratio_clamped_max": float(c.max()),
    }
