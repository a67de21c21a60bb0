"""PPO's value-model loss: clipped squared error to the GAE returns (NeMo-RL's ``MseValueLossFn``,
``value_loss_fn: {scale, cliprange}``).

With the value model's predictions ``v_t`` now, its predictions ``v_old_t`` when the step's
advantages were computed (the ``values`` stage) and the returns ``R_t``::

    v_clip_t = v_old_t + clamp(v_t - v_old_t, -cliprange, cliprange)
    L = 0.5 * scale * mean_t max((v_t - R_t)^2, (v_clip_t - R_t)^2)       (cliprange set and > 0)
    L = 0.5 * scale * mean_t (v_t - R_t)^2                                  (cliprange null or 0)

over the response tokens of the valid samples of the global batch (``token_mask * sample_mask``,
position ``t`` holding token ``t``; micro-batch losses sum to the global mean). Metrics: ``loss``,
``vf_clipfrac`` (share of tokens where the clipped error is the larger), ``values_mean``,
``returns_mean``. The worker hands this loss the per-token values ``[B, S]`` (its ``input_type``
is ``"values"``). No deviations from NeMo-RL's figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from nrl_tasks.algorithms.loss_functions import LossType
from nrl_tasks.algorithms.utils import masked_mean
from nrl_tasks.config.base import Section

__all__ = ["ValueLossConfig", "ValueLossFn"]


class ValueLossConfig(Section):
    """NeMo-RL's ``value_loss_fn`` keys."""

    scale: float = Field(1.0, ge=0.0, le=1e6, description="factor of the value loss")
    cliprange: float | None = Field(None, ge=0.0, le=1e6, description="value clipping around the step's old values "
                                    "(null or 0: none)")


class ValueLossFn:
    """The value model's loss (see the module docstring)."""

    loss_type = LossType.TOKEN_LEVEL
    #: what the worker passes as the first argument: the per-token values, ``[B, S]``
    input_type = "values"
    metric_reductions: dict[str, str] = {}

    def __init__(self, cfg: ValueLossConfig | None = None) -> None:
        self.cfg = cfg or ValueLossConfig()

    def __call__(
        self,
        values: Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float | None,
        global_valid_toks: Tensor | float | None,
    ) -> tuple[Tensor, dict[str, float]]:
        v = values.to(torch.float32)
        returns = data["returns"].to(v.device, torch.float32)
        mask = data["token_mask"].to(v.device, torch.float32) * data["sample_mask"].to(v.device, torch.float32).unsqueeze(1)
        n = global_valid_toks if global_valid_toks is not None else mask.sum()
        mean = lambda x: masked_mean(x, mask, global_normalization_factor=n)  # noqa: E731
        err = (v - returns) ** 2
        clip = self.cfg.cliprange
        if clip:
            old = data["values"].to(v.device, torch.float32)
            clipped = (old + (v - old).clamp(-clip, clip) - returns) ** 2
            loss = 0.5 * self.cfg.scale * mean(torch.maximum(err, clipped))
            clipfrac = mean((clipped > err).float()).item()
        else:
            loss = 0.5 * self.cfg.scale * mean(err)
            clipfrac = 0.0
        with torch.no_grad():
            metrics = {"loss": loss.item(), "vf_clipfrac": clipfrac, "values_mean": mean(v).item(),
                       "returns_mean": mean(returns).item(), "num_valid_samples": float(data["sample_mask"].sum())}
        return loss, metrics
