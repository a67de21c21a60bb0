"""The built-in arithmetic task: deterministic prompts, correct answers, exact-match parsing."""

from __future__ import annotations

import re

import pytest

from nrl_tasks.environments.arithmetic import exact_match_reward, extract_first_integer, make_arithmetic_prompts


def test_prompts_are_deterministic_per_seed_and_answers_are_correct():
    a = make_arithmetic_prompts(50, seed=3, max_operand=12, ops=("+", "-", "*"))
    assert a == make_arithmetic_prompts(50, seed=3, max_operand=12, ops=("+", "-", "*"))
    assert a != make_arithmetic_prompts(50, seed=4, max_operand=12, ops=("+", "-", "*"))
    seen_ops = set()
    for item in a:
        m = re.fullmatch(r"What is (\d+)([+\-*])(\d+)\? Answer:", item["prompt"])
        assert m, item
        x, op, y = int(m[1]), m[2], int(m[3])
        assert 0 <= x <= 12 and 0 <= y <= 12
        seen_ops.add(op)
        assert int(item["answer"]) == {"+": x + y, "-": x - y, "*": x * y}[op]
        assert int(item["answer"]) >= 0
    assert seen_ops == {"+", "-", "*"}


def test_prompt_generator_rejects_bad_arguments():
    assert make_arithmetic_prompts(0, seed=0) == []
    with pytest.raises(ValueError, match="ops"):
        make_arithmetic_prompts(3, seed=0, ops=("/",))
    with pytest.raises(ValueError, match="num"):
        make_arithmetic_prompts(-1, seed=0)


def test_exact_match_reward_parses_the_first_integer():
    responses = [" 7", "7.", " 7<|im_end|>", "It is 7", "3+4=7", " 70", " -7", "", " seven", " 07"]
    rewards = exact_match_reward(["What is 3+4? Answer:"] * len(responses), responses, ["7"] * len(responses))
    assert rewards == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert exact_match_reward(["p"], [" -3 apples"], ["-3"]) == [1.0]
    assert extract_first_integer("x=-12, y=4") == -12


def test_exact_match_reward_length_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="differ in length"):
        exact_match_reward(["p", "q"], ["1"], ["1", "2"])


def test_few_shot_prefix_keeps_the_problems_and_solves_its_examples():
    plain = make_arithmetic_prompts(20, seed=5, ops=("+", "*"))
    shot = make_arithmetic_prompts(20, seed=5, ops=("+", "*"), few_shot=3)
    assert shot == make_arithmetic_prompts(20, seed=5, ops=("+", "*"), few_shot=3)
    for p, s in zip(plain, shot, strict=True):
        lines = s["prompt"].split("\n")
        assert len(lines) == 4 and lines[-1] == p["prompt"] and s["answer"] == p["answer"]
        for line in lines[:-1]:
            m = re.fullmatch(r"What is (\d+)([+*])(\d+)\? Answer: (\d+)", line)
            assert m and int(m[4]) == (int(m[1]) + int(m[3]) if m[2] == "+" else int(m[1]) * int(m[3]))
    with pytest.raises(ValueError, match="few_shot"):
        make_arithmetic_prompts(1, seed=0, few_shot=-1)
