"""Verifiable environments: the built-in arithmetic task and user reward-function plug-ins."""

from __future__ import annotations

from nrl_tasks.environments.arithmetic import (
    PROMPT_TEMPLATE,
    exact_match_reward,
    extract_first_integer,
    make_arithmetic_prompts,
)
from nrl_tasks.environments.rewards import DEFAULT_REWARD_FN, RewardFn, load_reward_fn, safe_rewards

__all__ = [
    "DEFAULT_REWARD_FN",
    "PROMPT_TEMPLATE",
    "RewardFn",
    "exact_match_reward",
    "extract_first_integer",
    "load_reward_fn",
    "make_arithmetic_prompts",
    "safe_rewards",
]
