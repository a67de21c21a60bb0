"""Direct Preference Optimization (Rafailov et al., https://arxiv.org/abs/2305.18290), NeMo-RL's
``DPOLossFn`` keys and calling convention.

A batch holds preference pairs interleaved: row ``2i`` is the chosen response of pair ``i``,
row ``2i + 1`` the rejected one (same prompt). With ``beta = reference_policy_kl_penalty`` the
implicit reward of a response ``y`` is::

    r(y) = beta * sum_t (log pi(y_t) - log pi_ref(y_t))        (mean over t with preference_average_log_probs)

    L_pref = -log sigmoid(r(chosen) - r(rejected))
    L_sft  = -sum_t log pi(chosen_t)                            (mean over t with sft_average_log_probs)
    L      = preference_loss_weight * L_pref + sft_loss_weight * L_sft

each averaged over the valid pairs of the global batch (``global_valid_seqs / 2``: micro-batch
losses sum to the global mean). A pair counts when its chosen row's ``sample_mask`` is 1 (NeMo-RL's
rule). Metrics: ``loss``, ``preference_loss``, ``sft_loss``, ``accuracy`` (share of pairs with
``r(chosen) > r(rejected)``), ``rewards_chosen_mean``, ``rewards_rejected_mean``,
``rewards_margin_mean``, ``num_valid_samples`` (pairs).

Deviation from NeMo-RL: the function takes the gathered next-token logprobs (as every loss here),
and an odd number of rows or a pair split across micro-batches is a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from nrl_tasks.algorithms.loss_functions import LossType, _masked_inputs
from nrl_tasks.algorithms.utils import masked_mean
from nrl_tasks.config.base import Section

__all__ = ["DPOLossConfig", "DPOLossFn", "preference_metrics"]


class DPOLossConfig(Section):
    """NeMo-RL's ``dpo`` loss keys (same defaults)."""

    reference_policy_kl_penalty: float = Field(0.05, gt=0.0, description="beta")
    preference_loss_weight: float = Field(1.0, ge=0.0)
    sft_loss_weight: float = Field(0.0, ge=0.0)
    preference_average_log_probs: bool = False
    sft_average_log_probs: bool = False


class DPOLossFn:
    """The DPO loss (see the module docstring)."""

    loss_type = LossType.SEQUENCE_LEVEL
    metric_reductions: dict[str, str] = {}

    def __init__(self, cfg: DPOLossConfig | Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg if isinstance(cfg, DPOLossConfig) else DPOLossConfig(**(cfg or {}))

    def __call__(
        self,
        next_token_logprobs: Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float | None,
        global_valid_toks: Tensor | float | None,
    ) -> tuple[Tensor, dict[str, float]]:
        cfg = self.cfg
        if next_token_logprobs.shape[0] % 2:
            raise ValueError(
                f"DPO batches hold (chosen, rejected) pairs on adjacent rows: got {next_token_logprobs.shape[0]} rows"
            )
        curr, token_mask, sample_mask, _, d = _masked_inputs(next_token_logprobs, data, ("reference_policy_logprobs",))
        per_seq = masked_mean if cfg.preference_average_log_probs else _masked_sum
        reward = cfg.reference_policy_kl_penalty * per_seq(curr - d["reference_policy_logprobs"], token_mask, dim=-1)
        chosen, rejected = reward[0::2], reward[1::2]
        pairs = sample_mask[0::2]
        n = (global_valid_seqs / 2) if global_valid_seqs is not None else pairs.sum()
        mean = lambda x: masked_mean(x, pairs, global_normalization_factor=n)  # noqa: E731
        margin = chosen - rejected
        pref = mean(-torch.nn.functional.logsigmoid(margin))
        nll = (masked_mean if cfg.sft_average_log_probs else _masked_sum)(-curr[0::2], token_mask[0::2], dim=-1)
        sft = mean(nll)
        loss = cfg.preference_loss_weight * pref + cfg.sft_loss_weight * sft
        with torch.no_grad():
            metrics = {"loss": loss.item(), "preference_loss": pref.item(), "sft_loss": sft.item(),
                       **preference_metrics(chosen, rejected, pairs, mean)}
        return loss, metrics


def preference_metrics(chosen: Tensor, rejected: Tensor, pairs: Tensor, mean: Callable[[Tensor], Tensor]) -> dict[str, float]:
    """The figures of a batch of pairs scored ``chosen`` / ``rejected`` (DPO's implicit rewards, a
    reward model's scores): ``accuracy`` (share with chosen above rejected), the chosen, rejected
    and margin means (``mean``: over the valid pairs of the global batch), ``num_valid_samples``."""
    margin = chosen - rejected
    return {
        "accuracy": mean((margin > 0).float()).item(),
        "rewards_chosen_mean": mean(chosen).item(),
        "rewards_rejected_mean": mean(rejected).item(),
        "rewards_margin_mean": mean(margin).item(),
        "num_valid_samples": pairs.sum().item(),
    }


def _masked_sum(values: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    return torch.where(mask > 0, values, torch.zeros_like(values)).sum(dim=dim)
