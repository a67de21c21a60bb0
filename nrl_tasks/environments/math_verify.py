"""NeMo-RL's ``math`` environment as a reward function: the response's final answer checked
against the reference with `math-verify <https://github.com/huggingface/Math-Verify>`_.

As NeMo-RL's ``hf_math_verify`` (its ``env.math.math_verify_impl`` default): the reference is
parsed as LaTeX inside ``\\boxed{...}``, the response's answer is extracted as a plain expression
or as LaTeX (the last ``\\boxed{}`` first), and the two compare symbolically (``1/2`` equals
``0.5``, ``\\frac{1}{2}``). A response the verifier cannot parse, or a comparison that raises or
times out, scores 0. ``math_reward`` has the signature of ``env.reward_fn``; a NeMo-RL config's
``data.default.env_name: math`` maps to it (:mod:`flows.config.nemo_rl_data`).

>>> math_reward(["q"] * 3, ["so the answer is \\\\boxed{\\\\frac{1}{2}}", "x = 0.5", "it is 3"], ["0.5", "1/2", "4"])
[1.0, 1.0, 0.0]
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["MATH_REWARD_FN", "math_reward"]

#: ``env.reward_fn`` of NeMo-RL's ``env_name: math``
MATH_REWARD_FN = "nrl_tasks.environments.math_verify:math_reward"


def _configs() -> tuple[Any, Any]:
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it logs every unparsable answer
    return (LatexExtractionConfig(),), (ExprExtractionConfig(), LatexExtractionConfig())


def math_reward(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """1.0 where the response's answer equals the reference (symbolically), else 0.0.

    math-verify bounds each parse and comparison with ``signal.alarm`` (5 s), which only the main
    thread may set: elsewhere (a Prefect task's worker thread) its limits are off, as NeMo-RL's
    verifier actors would not have them either off their main thread."""
    from math_verify import parse, verify

    gold_cfg, pred_cfg = _configs()
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    out = []
    for response, answer in zip(responses, answers):
        try:
            gold = parse("\\boxed{" + str(answer) + "}", extraction_config=gold_cfg, parsing_timeout=limit)
            pred = parse(str(response), extraction_config=pred_cfg, parsing_timeout=limit)
            out.append(1.0 if gold and pred and verify(gold, pred, timeout_seconds=limit) else 0.0)
        except BaseException as exc:  # noqa: BLE001 - math-verify's timeout is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            out.append(0.0)
    return out
