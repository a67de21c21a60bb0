"""Built-in verifiable task: short integer arithmetic with an exact-match reward.

Prompts follow one fixed template, ``"What is 3+4? Answer:"``, and the expected completion is
the result as a decimal integer right after it, e.g. ``" 7"`` (then end of sequence). The task
is small enough for a tiny model trained from scratch and answerable by a small pretrained
instruct model, so GRPO sees mixed rewards within a group from the first steps.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

__all__ = [
    "PROMPT_TEMPLATE",
    "exact_match_reward",
    "extract_first_integer",
    "make_arithmetic_prompts",
]

PROMPT_TEMPLATE = "What is {a}{op}{b}? Answer:"
"""Prompt format; the answer follows as ``" <integer>"``."""

_OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}
_INTEGER = re.compile(r"-?\d+")


def make_arithmetic_prompts(
    num: int,
    seed: int,
    *,
    max_operand: int = 9,
    ops: Sequence[str] = ("+",),
    few_shot: int = 0,
) -> list[dict[str, str]]:
    """``num`` problems ``{"prompt": "What is a<op>b? Answer:", "answer": "<int>"}``.

    Operands are drawn uniformly from ``0..max_operand`` by ``random.Random(seed)`` (same seed,
    same list, on every platform); the operator is drawn from ``ops``. For ``"-"`` the operands
    are ordered so the answer is never negative. ``few_shot=k`` prefixes every prompt with k
    solved problems, one per line (``"What is 2+3? Answer: 5\\n"``), drawn from a separate
    generator so the problems themselves do not change; a pretrained model (SmolLM2-135M-
    Instruct) then answers in the required format about half of the time, without it rarely.

    >>> make_arithmetic_prompts(2, seed=0)
    [{'prompt': 'What is 6+6? Answer:', 'answer': '12'}, {'prompt': 'What is 0+4? Answer:', 'answer': '4'}]
    >>> print(make_arithmetic_prompts(1, seed=0, few_shot=2)[0]["prompt"])
    What is 9+7? Answer: 16
    What is 8+0? Answer: 8
    What is 6+6? Answer:
    """
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    if not ops:
        raise ValueError("ops must name at least one operator")
    unknown = [op for op in ops if op not in _OPS]
    if unknown:
        raise ValueError(f"unsupported ops {unknown}; choose from {sorted(_OPS)}")
    if few_shot < 0:
        raise ValueError(f"few_shot must be >= 0, got {few_shot}")
    rng, shot_rng = random.Random(seed), random.Random(f"few-shot-{seed}")

    def draw(r: random.Random) -> tuple[str, str]:
        a, b = r.randint(0, max_operand), r.randint(0, max_operand)
        op = ops[0] if len(ops) == 1 else r.choice(list(ops))
        if op == "-" and a < b:
            a, b = b, a
        return PROMPT_TEMPLATE.format(a=a, op=op, b=b), str(_OPS[op](a, b))

    problems = []
    for _ in range(num):
        prompt, answer = draw(rng)
        shots = "".join(f"{q} {ans}\n" for q, ans in (draw(shot_rng) for _ in range(few_shot)))
        problems.append({"prompt": shots + prompt, "answer": answer})
    return problems


def extract_first_integer(text: str) -> int | None:
    """The first (optionally negative) decimal integer in ``text``, or ``None``.

    >>> extract_first_integer(" 12<|endoftext|>"), extract_first_integer("no digits")
    (12, None)
    """
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


def exact_match_reward(
    prompts: Sequence[str],
    responses: Sequence[str],
    answers: Sequence[str],
) -> list[float]:
    """1.0 where the response's first integer equals the answer, else 0.0.

    The required format is the integer right after ``"Answer:"``; the parser takes the *first*
    integer anywhere in the response, so ``" 7"``, ``"7."`` and ``"It is 7"`` all match ``"7"``
    while ``"3+4=7"`` does not (its first integer is 3). Answers are compared as integers
    (``"07"`` equals ``"7"``); a response without an integer scores 0.0. ``prompts`` is unused
    (kept for the reward-function plug-in signature).

    >>> exact_match_reward(["What is 3+4? Answer:"] * 3, [" 7", " 8", " seven"], ["7"] * 3)
    [1.0, 0.0, 0.0]
    """
    if not (len(prompts) == len(responses) == len(answers)):
        raise ValueError(
            f"prompts, responses and answers differ in length: {len(prompts)}, {len(responses)}, {len(answers)}"
        )
    rewards = []
    for response, answer in zip(responses, answers, strict=True):
        expected = extract_first_integer(str(answer))
        got = extract_first_integer(response)
        rewards.append(1.0 if got is not None and got == expected else 0.0)
    return rewards
