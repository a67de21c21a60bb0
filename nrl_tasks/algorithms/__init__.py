"""RL algorithms: GRPO advantages (:mod:`.utils`) and the training losses (:mod:`.loss_functions`)."""

from __future__ import annotations

from nrl_tasks.algorithms.loss_functions import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    LossFunction,
    LossType,
    NLLLoss,
    NLLLossFn,
)
from nrl_tasks.algorithms.utils import (
    calculate_baseline_and_std_per_prompt,
    calculate_kl,
    compute_grpo_advantages,
    masked_mean,
)

__all__ = [
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "LossFunction",
    "LossType",
    "NLLLoss",
    "NLLLossFn",
    "calculate_baseline_and_std_per_prompt",
    "calculate_kl",
    "compute_grpo_advantages",
    "masked_mean",
]
