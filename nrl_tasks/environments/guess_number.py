"""Built-in game environment: guess a number, told "higher" or "lower" after each guess.

``data.dataset: guess_number`` draws a secret integer in ``1..data.arithmetic.max_operand`` per
prompt (its ``answer``). Each assistant turn should name one number: the environment replies as
the user with ``"Higher."`` or ``"Lower."``, or ends the episode when the guess is right. Fewer
turns is better: a right guess on turn ``t`` is rewarded ``decay ** (t - 1)`` (``decay``:
``env.environment_kwargs.decay``, default 0.8); an episode that runs out of turns gets 0. A turn
without a number gets the reply ``"Say one number."`` and counts as a turn.

Each prompt row also carries a ``demonstration`` (what a warm start trains on): the game played
by bisection, its guesses and the environment's replies, at most ``ceil(log2(max_target)) + 1``
turns.
"""

from __future__ import annotations

import json
import random
from typing import Any

import torch

from nrl_tasks.environments.arithmetic import extract_first_integer
from nrl_tasks.environments.interfaces import EnvironmentInterface, EnvironmentReturn, MessageLog

__all__ = ["GuessNumberEnvironment", "bisection_demonstration", "make_guess_prompts"]


class GuessNumberEnvironment(EnvironmentInterface):
    """The guessing game (see the module docstring)."""

    def __init__(self, decay: float = 0.8) -> None:
        if not 0.0 < float(decay) <= 1.0:
            raise ValueError(f"env.environment_kwargs.decay must be in (0, 1], got {decay!r}")
        self.decay = float(decay)

    def step(self, message_logs: list[MessageLog], metadata: list[dict[str, Any] | None]) -> EnvironmentReturn:
        observations, rewards, done, answers, metas = [], [], [], [], []
        for log, meta in zip(message_logs, metadata):
            meta = dict(meta or {})
            turn = int(meta.get("guesses", 0)) + 1
            meta["guesses"] = turn
            text = log[-1]["content"] if log and log[-1]["role"] == "assistant" else ""
            guess, secret = extract_first_integer(text), int(str(meta.get("answer", "0")).strip() or 0)
            answers.append(None if guess is None else str(guess))
            if guess == secret:
                observations.append({"role": "user", "content": "Correct!"})
                rewards.append(self.decay ** (turn - 1))
                done.append(True)
            else:
                reply = "Say one number." if guess is None else ("Higher." if guess < secret else "Lower.")
                observations.append({"role": "user", "content": reply})
                rewards.append(0.0)
                done.append(False)
            metas.append(meta)
        return EnvironmentReturn(
            observations, metas, [None] * len(message_logs), torch.tensor(rewards, dtype=torch.float32),
            torch.tensor(done, dtype=torch.bool), answers,
        )


def bisection_demonstration(secret: int, top: int) -> list[dict[str, str]]:
    """The messages after the prompt of a game played by bisection on ``1..top``.

    >>> [m["content"] for m in bisection_demonstration(3, 8)]
    ['4', 'Lower.', '2', 'Higher.', '3']
    """
    lo, hi, out = 1, top, []
    while True:
        guess = (lo + hi) // 2
        out.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            return out
        lo, hi = (guess + 1, hi) if guess < secret else (lo, guess - 1)
        out.append({"role": "user", "content": "Higher." if guess < secret else "Lower."})


def make_guess_prompts(num: int, seed: int, *, max_target: int = 100) -> list[dict[str, str]]:
    """``num`` games ``{"prompt", "answer", "demonstration"}``: a secret in ``1..max_target``
    drawn by ``random.Random(seed)``, and its game played by bisection (JSON text).

    >>> make_guess_prompts(1, seed=0, max_target=10)[0]["prompt"]
    "I'm thinking of a number between 1 and 10. Guess it: reply with one number; I'll say higher or lower."
    """
    rng = random.Random(seed)
    top = max(1, int(max_target))
    prompt = f"I'm thinking of a number between 1 and {top}. Guess it: reply with one number; I'll say higher or lower."
    secrets = [rng.randint(1, top) for _ in range(num)]
    return [{"prompt": prompt, "answer": str(s), "demonstration": json.dumps(bisection_demonstration(s, top))} for s in secrets]
