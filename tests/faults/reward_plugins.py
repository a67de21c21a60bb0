"""Misbehaving reward functions for the bad-input tests (``env.reward_fn: "tests.faults.reward_plugins:..."``)."""

from __future__ import annotations

from typing import Sequence


def nan_for_long_responses(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """1.0 for a correct answer, NaN for responses longer than 2 characters, else 0.0."""
    return [float("nan") if len(r) > 2 else float(r.strip() == a) for r, a in zip(responses, answers)]


def always_raises(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    raise RuntimeError("reward service unavailable")


def exits_zero(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """A plug-in that ends the process the polite way: ``sys.exit(0)``."""
    import sys

    sys.exit(0)


def huge_rewards(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """A finite reward far beyond any sensible scale for the first sample of each call, 0 elsewhere."""
    return [1e30 if i == 0 else 0.0 for i in range(len(responses))]
