"""Reward-model training with the Bradley-Terry loss (Bradley & Terry 1952; as in Ouyang et al.,
https://arxiv.org/abs/2203.02155), NeMo-RL's ``PreferenceLossFn`` (``policy.reward_model_cfg:
{enabled: true, reward_model_type: bradley_terry}``).

A batch holds preference pairs interleaved, as DPO's: row ``2i`` is the chosen response of pair
``i``, row ``2i + 1`` the rejected one. The model is a sequence classifier with one output; its
score ``r(y)`` of a row is the head at the row's last valid token. Then::

    L = -log sigmoid(r(chosen) - r(rejected))

averaged over the valid pairs of the global batch (``global_valid_seqs / 2``: micro-batch losses
sum to the global mean). A pair counts when its chosen row's ``sample_mask`` is 1. Metrics:
``loss``, ``accuracy`` (share of pairs with ``r(chosen) > r(rejected)``),
``rewards_chosen_mean``, ``rewards_rejected_mean``, ``rewards_margin_mean``,
``num_valid_samples`` (pairs).

The worker feeds this loss the scores ``[B]`` rather than token logprobs: its ``input_type`` is
``"scores"`` (NeMo-RL's ``LossInputType.LOGIT``). Deviations from NeMo-RL: the rejected mean is
taken over the pairs whose chosen row counts (NeMo-RL masks it by the rejected rows' mask, the same
for every batch built here); ``rewards_margin_mean`` is added; an odd number of rows is a
``ValueError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from nrl_tasks.algorithms.dpo import preference_metrics
from nrl_tasks.algorithms.loss_functions import LossType
from nrl_tasks.algorithms.utils import masked_mean

__all__ = ["BradleyTerryLossFn"]


class BradleyTerryLossFn:
    """The Bradley-Terry loss of a reward model (see the module docstring)."""

    loss_type = LossType.SEQUENCE_LEVEL
    #: what the worker passes as the first argument: each row's score, ``[B]``
    input_type = "scores"
    metric_reductions: dict[str, str] = {}

    def __call__(
        self,
        scores: Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float | None,
        global_valid_toks: Tensor | float | None,
    ) -> tuple[Tensor, dict[str, float]]:
        if scores.dim() != 1 or scores.shape[0] % 2:
            raise ValueError(f"reward-model batches hold (chosen, rejected) pairs on adjacent rows: scores of shape "
                             f"{tuple(scores.shape)}")
        scores = scores.to(torch.float32)
        chosen, rejected = scores[0::2], scores[1::2]
        pairs = data["sample_mask"].to(scores.device, torch.float32)[0::2]
        n = (global_valid_seqs / 2) if global_valid_seqs is not None else pairs.sum()
        mean = lambda x: masked_mean(x, pairs, global_normalization_factor=n)  # noqa: E731
        loss = mean(-torch.nn.functional.logsigmoid(chosen - rejected))
        with torch.no_grad():
            metrics = {"loss": loss.item(), **preference_metrics(chosen, rejected, pairs, mean)}
        return loss, metrics
