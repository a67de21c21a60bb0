"""Reward-function plug-ins: load one by import path and call it without crashing a run.

A reward function takes three equally long sequences of strings and returns one float per
sample::

    def my_reward(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]

Configure it as ``env.reward_fn: "package.module:function"``. :func:`safe_rewards` turns
whatever it does (raise, return NaN, return the wrong number of values) into a reward tensor
plus a validity mask, so bad samples are masked out of the GRPO baseline and the loss instead
of ending the run.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from nrl_tasks.utils.import_path import import_attribute

__all__ = ["DEFAULT_REWARD_FN", "RewardFn", "load_reward_fn", "safe_rewards"]

RewardFn = Callable[[list[str], list[str], list[str]], Sequence[float]]

DEFAULT_REWARD_FN = "nrl_tasks.environments.arithmetic:exact_match_reward"
"""The built-in arithmetic task's exact-match reward."""


def load_reward_fn(path: str, *, isolate: bool = False) -> RewardFn:
    """Import ``"package.module:function"`` (the attribute may be dotted: ``module:Class.method``).

    Raises ``ValueError`` for a malformed path, a module that cannot be imported or a missing
    attribute, and ``TypeError`` when the attribute is not callable. ``isolate`` (preflight): a
    user's module is imported in a child process first, under a time limit
    (:func:`nrl_tasks.utils.import_path.import_attribute`).

    >>> load_reward_fn(DEFAULT_REWARD_FN).__name__
    'exact_match_reward'
    """
    if not isinstance(path, str) or path.count(":") != 1:
        raise ValueError(f"reward_fn must look like 'package.module:function', got {path!r}")
    module_name, attr_path = path.split(":")
    if not module_name or not attr_path:
        raise ValueError(f"reward_fn must look like 'package.module:function', got {path!r}")
    obj = import_attribute(module_name, attr_path, f"reward_fn {path!r}", isolate=isolate)
    if not callable(obj):
        raise TypeError(f"reward_fn {path!r} is a {type(obj).__name__}, not a callable")
    return obj


#: The largest magnitude a reward may have: rewards are stored as float32.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _as_float(value: Any) -> float | None:
    """A finite float within float32 range, or None for anything else (NaN, inf, beyond
    float32 such as 1e39, None, strings, arrays)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    if isinstance(value, bool | numbers.Real) or (hasattr(value, "dtype") and getattr(value, "shape", None) == ()):
        try:
            out = float(value)
        except (TypeError, ValueError):
            return None
        except OverflowError:  # an int beyond float64
            return None
        return out if math.isfinite(out) and abs(out) <= FLOAT32_MAX else None
    return None


def safe_rewards(
    fn: RewardFn,
    prompts: Sequence[str],
    responses: Sequence[str],
    answers: Sequence[str],
) -> tuple[Tensor, Tensor, list[str]]:
    """Call ``fn(prompts, responses, answers)`` and validate what it returns.

    Returns ``(rewards [B] float32, valid_mask [B] bool, errors)``. A sample whose reward is
    NaN/inf, beyond float32 range (``abs > 3.4e38``, e.g. 1e39) or not a number is masked
    (reward 0.0) and counted in one error line; if ``fn`` raises or returns something other
    than B values, the whole batch is masked and the error says why. ``errors`` is empty when
    every reward is valid. Mismatched input lengths are the caller's bug and raise ``ValueError``.

    >>> r, ok, errs = safe_rewards(lambda p, r, a: [1.0, float("nan")], ["p", "p"], ["r", "r"], ["a", "a"])
    >>> r.tolist(), ok.tolist(), errs
    ([1.0, 0.0], [True, False], ['1 of 2 rewards invalid (NaN/inf, beyond float32 or not a number) at indices [1]'])
    """
    n = len(prompts)
    if not (n == len(responses) == len(answers)):
        raise ValueError(
            f"prompts, responses and answers differ in length: {n}, {len(responses)}, {len(answers)}"
        )
    rewards = torch.zeros(n, dtype=torch.float32)
    valid = torch.zeros(n, dtype=torch.bool)
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        raw = fn(list(prompts), list(responses), list(answers))
    except Exception as exc:  # a user plug-in may raise anything: mask the batch, keep the run
        return rewards, valid, [f"reward function {name} raised {type(exc).__name__}: {exc}; all {n} samples masked"]

    if isinstance(raw, torch.Tensor):
        raw = raw.detach().cpu().reshape(-1).tolist() if raw.ndim == 1 else raw
    try:
        values = list(raw)
    except TypeError:
        return rewards, valid, [f"reward function {name} returned {type(raw).__name__}, not a sequence; all {n} samples masked"]
    if len(values) != n:
        return rewards, valid, [f"reward function {name} returned {len(values)} rewards for {n} samples; all masked"]

    bad = []
    for i, value in enumerate(values):
        converted = _as_float(value)
        if converted is None:
            bad.append(i)
        else:
            rewards[i] = converted
            valid[i] = True
    errors = []
    if bad:
        shown = bad[:20] if len(bad) <= 20 else [*bad[:20], "..."]
        errors.append(f"{len(bad)} of {n} rewards invalid (NaN/inf, beyond float32 or not a number) at indices {shown}")
    return rewards, valid, errors
