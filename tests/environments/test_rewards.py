"""Reward plug-ins: loading by import path, and NaN/raise/wrong-length handling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nrl_tasks.environments.rewards import DEFAULT_REWARD_FN, load_reward_fn, safe_rewards

P, R, A = ["What is 1+1? Answer:"] * 4, [" 2", " 3", " 2", "x"], ["2"] * 4

NOT_CALLABLE = 42


def length_reward(prompts, responses, answers):
    return [float(len(r)) for r in responses]


def test_load_builtin_and_user_functions():
    fn = load_reward_fn(DEFAULT_REWARD_FN)
    assert fn(P, R, A) == [1.0, 0.0, 1.0, 0.0]
    user = load_reward_fn(f"{__name__}:length_reward")
    assert user(P, R, A) == [2.0, 2.0, 2.0, 1.0]
    assert load_reward_fn("math:sqrt") is math.sqrt


@pytest.mark.parametrize(
    "path,exc,match",
    [
        ("no_colon_here", ValueError, "package.module:function"),
        ("a:b:c", ValueError, "package.module:function"),
        (":fn", ValueError, "package.module:function"),
        ("nrl_no_such_module_xyz:fn", ValueError, "cannot import module 'nrl_no_such_module_xyz'"),
        ("nrl_tasks.environments.arithmetic:nope", ValueError, "has no attribute 'nope'"),
        (f"{__name__}:NOT_CALLABLE", TypeError, "not a callable"),
    ],
)
def test_load_errors_are_clear(path, exc, match):
    with pytest.raises(exc, match=match):
        load_reward_fn(path)


def test_valid_rewards_pass_through_in_any_container():
    for out in ([1, 0.5, True, 0], np.array([1, 0.5, 1, 0]), torch.tensor([1, 0.5, 1, 0])):
        rewards, valid, errors = safe_rewards(lambda p, r, a, out=out: out, P, R, A)
        assert rewards.dtype == torch.float32 and valid.dtype == torch.bool
        assert rewards.tolist() == [1.0, 0.5, 1.0, 0.0]
        assert valid.all() and errors == []


def test_nan_and_non_numbers_mask_only_those_samples():
    rewards, valid, errors = safe_rewards(lambda p, r, a: [1.0, float("nan"), None, float("inf")], P, R, A)
    assert valid.tolist() == [True, False, False, False]
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert len(errors) == 1 and "3 of 4" in errors[0] and "[1, 2, 3]" in errors[0]


def test_raising_function_masks_the_whole_batch():
    def broken(prompts, responses, answers):
        raise RuntimeError("grader offline")

    rewards, valid, errors = safe_rewards(broken, P, R, A)
    assert not valid.any() and rewards.tolist() == [0.0] * 4
    assert len(errors) == 1 and "RuntimeError: grader offline" in errors[0]


@pytest.mark.parametrize("out", [[1.0, 0.0], 3.0, torch.ones(2, 2)])
def test_wrong_length_or_type_masks_the_whole_batch(out):
    rewards, valid, errors = safe_rewards(lambda p, r, a: out, P, R, A)
    assert not valid.any() and len(errors) == 1 and "masked" in errors[0]


def test_input_length_mismatch_is_the_callers_error():
    with pytest.raises(ValueError, match="differ in length"):
        safe_rewards(length_reward, P, R[:2], A)
