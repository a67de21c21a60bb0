"""Off-policy importance-sampling weights between the generator and the trainer.

The rollouts are sampled by the generation workers (``generation_logprobs``, log pi_gen) and
trained against the policy that scored them (``prev_logprobs``, log pi_old): a different engine,
or older weights in async GRPO. The actor loss is reweighted by (NeMo-RL's
``use_importance_sampling_correction``; all weights detached)::

    token level:     w_t = exp(prev_t - gen_t)
    sequence level:  w_i = exp(sum_t (prev_t - gen_t))            (GSPO, https://arxiv.org/abs/2507.18071)

Truncation (``truncated_importance_sampling_type`` with ``truncated_importance_sampling_ratio``
= max and ``truncated_importance_sampling_ratio_min`` = min):

- ``tis``: ``w = clamp(w, min, max)`` (min 0 when unset; https://fengyao.notion.site/off-policy-rl);
- ``icepop``: tokens whose weight is outside ``[min, max]`` get weight 0;
- ``seq-mask-tis``: a sequence whose geometric-mean weight ``exp(mean_t(prev_t - gen_t))`` is
  outside ``[min, max]`` gets weight 0 for all its tokens; kept sequences keep their untruncated
  token weights.

``is_oob_ratio`` is the fraction of tokens (``tis``, ``icepop``) or sequences (``seq-mask-tis``)
outside the bounds, normalised by the global count (micro-batch values sum to the global one).
Deviation from NeMo-RL: ``truncated_importance_sampling_ratio`` without a type means ``tis``
(NeMo-RL's earlier behaviour; its current code refuses it at the first call).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nrl_tasks.algorithms.utils import masked_mean

__all__ = ["actor_importance_weights"]


def _finite(w: Tensor) -> Tensor:
    return torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)


def actor_importance_weights(
    prev: Tensor,
    gen: Tensor,
    token_mask: Tensor,
    sample_mask: Tensor,
    cfg: Any,
    global_valid_toks: Tensor | float | None,
    global_valid_seqs: Tensor | float | None,
) -> tuple[Tensor, dict[str, float]]:
    """``(weights, metrics)``: ``[B, S-1]`` token weights, or ``[B, 1]`` sequence weights with
    ``cfg.sequence_level_importance_ratios``; inputs ``[B, S-1]`` zero outside ``token_mask``."""
    mask = token_mask * sample_mask.unsqueeze(-1)
    diff = (prev - gen).detach()
    if cfg.sequence_level_importance_ratios:
        w = _finite(torch.exp((diff * mask).sum(dim=-1))).unsqueeze(-1)
    else:
        w = _finite(torch.exp(diff))
    kind, hi, lo = cfg.truncated_importance_sampling_type, cfg.truncated_importance_sampling_ratio, cfg.truncated_importance_sampling_ratio_min
    if hi is None:
        return w, {}
    kind = kind or "tis"
    if kind == "tis":
        lo = 0.0 if lo is None else lo
        oob = ((w > hi) | (w < lo)).float()
        w = w.clamp(min=lo, max=hi)
    elif kind == "icepop":
        keep = (w >= lo) & (w <= hi)
        oob = (~keep).float()
        w = torch.where(keep, w, torch.zeros_like(w))
    elif kind == "seq-mask-tis":
        geo = torch.exp(masked_mean(_finite(diff), token_mask, dim=-1))  # [B]
        kept = ((geo >= lo) & (geo <= hi)).float()
        w = w * kept.unsqueeze(-1)
        ratio = masked_mean(1.0 - kept, sample_mask, global_normalization_factor=global_valid_seqs)
        return w, {"is_oob_ratio": float(ratio)}
    else:
        raise ValueError(f"truncated_importance_sampling_type must be 'tis', 'icepop' or 'seq-mask-tis', got {kind!r}")
    if cfg.sequence_level_importance_ratios:  # one weight per sequence: count sequences
        ratio = masked_mean(oob.squeeze(-1), sample_mask, global_normalization_factor=global_valid_seqs)
    else:
        ratio = masked_mean(oob, mask, global_normalization_factor=global_valid_toks)
    return w, {"is_oob_ratio": float(ratio)}
