"""The environment interface, NeMo-RL's shape: what a multi-turn or tool-using task implements.

An environment sees whole conversations and answers the policy's latest turn::

    class MyEnv(EnvironmentInterface):
        def step(self, message_logs, metadata):
            # message_logs[i]: [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]
            # metadata[i]: the episode's state, starting as its prompt's data row ({"prompt", "answer", ...})
            return EnvironmentReturn(observations, metadata, next_stop_strings, rewards, terminateds, answers)

The meanings are NeMo-RL's:

- ``observations[i]``: one message ``{"role": ..., "content": ...}`` appended to conversation ``i``
  (``"tool"`` for a tool's result, ``"user"`` for a game's reply, ``"environment"`` for anything else);
  ignored once the episode terminates;
- ``metadata[i]``: the episode's state after this turn (JSON-able: it is persisted with the rollouts),
  handed back on the next turn;
- ``next_stop_strings[i]``: the stop strings of the episode's next turn, or ``None`` for the configured ones;
- ``rewards``: float tensor ``[B]``, this turn's reward (an episode's reward is the sum over its turns);
- ``terminateds``: bool tensor ``[B]``, the episode is over;
- ``answers[i]``: the answer the environment extracted from the turn (for logs), or ``None``.

``global_post_process_and_metrics(batch)`` runs once per step on the finished rollouts (the
default returns them unchanged, without metrics). Environments run as Ray actors
(``env.num_workers``), each given a slice of the batch: ``step`` must depend only on its
arguments for a run to be resumable bit for bit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple, TypedDict

import torch

__all__ = ["EnvironmentInterface", "EnvironmentReturn", "Message", "MessageLog", "check_environment_return"]


class Message(TypedDict):
    """One turn of a conversation."""

    role: str
    content: str


MessageLog = list[Message]


class EnvironmentReturn(NamedTuple):
    """What :meth:`EnvironmentInterface.step` returns (see the module docstring)."""

    observations: list[Message]
    metadata: list[dict[str, Any] | None]
    next_stop_strings: list[list[str] | None]
    rewards: torch.Tensor
    terminateds: torch.Tensor
    answers: list[str | None] | None = None


class EnvironmentInterface(ABC):
    """A multi-turn environment (see the module docstring)."""

    @abstractmethod
    def step(self, message_logs: list[MessageLog], metadata: list[dict[str, Any] | None]) -> EnvironmentReturn:
        """Answer the latest assistant turn of each conversation."""

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, Any]]:
        """The step's finished rollouts, post-processed, and metrics for the step's metrics line."""
        return batch, {}


def check_environment_return(out: Any, batch: int, name: str) -> EnvironmentReturn:
    """``out`` as an :class:`EnvironmentReturn` for a batch of ``batch`` conversations, or a
    ``ValueError`` / ``TypeError`` naming the environment ``name`` and what is wrong."""
    where = f"environment {name}: step() returned"
    if not isinstance(out, tuple) or len(out) not in (5, 6):
        raise TypeError(f"{where} a {type(out).__name__}, not an EnvironmentReturn")
    out = EnvironmentReturn(*out)
    for field in ("observations", "metadata", "next_stop_strings"):
        value = getattr(out, field)
        if not isinstance(value, (list, tuple)) or len(value) != batch:
            raise ValueError(f"{where} {field} of length {len(value) if hasattr(value, '__len__') else '?'}, expected {batch}")
    for i, obs in enumerate(out.observations):
        if not isinstance(obs, dict) or not isinstance(obs.get("role"), str) or not isinstance(obs.get("content"), str):
            raise ValueError(f"{where} observations[{i}] = {obs!r:.200}, not a message {{'role': str, 'content': str}}")
    for i, stops in enumerate(out.next_stop_strings):
        if stops is not None and (not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops)):
            raise ValueError(f"{where} next_stop_strings[{i}] = {stops!r:.200}, not None or a list of non-empty strings")
    for i, meta in enumerate(out.metadata):
        if meta is not None and not isinstance(meta, dict):
            raise ValueError(f"{where} metadata[{i}] is a {type(meta).__name__}, not a dict or None")
    rewards, terminateds = out.rewards, out.terminateds
    if not isinstance(rewards, torch.Tensor) or tuple(rewards.shape) != (batch,):
        raise ValueError(f"{where} rewards of shape {_shape(rewards)}, expected a tensor of shape [{batch}]")
    if not isinstance(terminateds, torch.Tensor) or tuple(terminateds.shape) != (batch,):
        raise ValueError(f"{where} terminateds of shape {_shape(terminateds)}, expected a tensor of shape [{batch}]")
    if out.answers is not None and len(out.answers) != batch:
        raise ValueError(f"{where} answers of length {len(out.answers)}, expected {batch}")
    return out._replace(
        observations=[{"role": o["role"], "content": o["content"]} for o in out.observations],
        metadata=list(out.metadata), next_stop_strings=[list(s) if s is not None else None for s in out.next_stop_strings],
        rewards=rewards.detach().to(torch.float32).cpu(), terminateds=terminateds.detach().to(torch.bool).cpu(),
    )


def _shape(x: Any) -> str:
    return str(list(x.shape)) if hasattr(x, "shape") else type(x).__name__
