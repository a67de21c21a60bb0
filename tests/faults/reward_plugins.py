"""Misbehaving reward functions for the bad-input tests (``env.reward_fn: "tests.faults.reward_plugins:..."``)."""

from __future__ import annotations

from typing import Sequence


def nan_for_long_responses(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """1.0 for a correct answer, NaN for responses longer than 2 characters, else 0.0."""
    return [float("nan") if len(r) > 2 else float(r.strip() == a) for r, a in zip(responses, answers)]


def always_raises(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    raise RuntimeError("reward service unavailable")
