"""DAPO's soft overlong punishment (``grpo.reward_shaping``, NeMo-RL's keys).

DAPO (https://arxiv.org/abs/2503.14476, eq. 13), with ``L_max = max_response_length`` and
``L_cache = overlong_buffer_length``, adds to the reward of a response of ``|y|`` tokens::

    0                                      if |y| <= L_max - L_cache
    ((L_max - L_cache) - |y|) / L_cache    if L_max - L_cache < |y| <= L_max
    -1                                     if |y| > L_max

scaled by ``overlong_buffer_penalty``. Only valid rewards are shaped (an invalid one stays masked).
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from torch import Tensor

from nrl_tasks.config.base import Section

__all__ = ["RewardShapingConfig", "overlong_penalty"]


class RewardShapingConfig(Section):
    enabled: bool = False
    overlong_buffer_length: int = Field(128, ge=1, description="L_cache: tokens before L_max where the penalty ramps up")
    overlong_buffer_penalty: float = Field(1.0, ge=0.0, description="the penalty at L_max")
    max_response_length: int | None = Field(None, ge=1, description="L_max (default: the generation's max_new_tokens)")

    @model_validator(mode="after")
    def _check(self) -> "RewardShapingConfig":
        if self.enabled and self.max_response_length is not None and self.overlong_buffer_length > self.max_response_length:
            raise ValueError(
                f"grpo.reward_shaping.overlong_buffer_length ({self.overlong_buffer_length}) exceeds "
                f"grpo.reward_shaping.max_response_length ({self.max_response_length})"
            )
        return self


def overlong_penalty(lengths: Tensor, max_response_length: int, buffer_length: int, penalty: float) -> Tensor:
    """``[B]`` float32 reward terms (<= 0) for responses of ``lengths`` tokens (see the module docstring).

    >>> overlong_penalty(torch.tensor([10, 12, 14, 16, 20]), 16, 4, 1.0).tolist()
    [0.0, 0.0, -0.5, -1.0, -1.0]
    """
    expected = max_response_length - buffer_length
    over = (lengths.to(torch.float64) - expected).clamp(min=0.0) / buffer_length
    return (0.0 - penalty * over.clamp(max=1.0)).to(torch.float32)
