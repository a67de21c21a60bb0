"""The step schedule of a run: which weights version generates each step's rollouts, what may
run at the same time, and when the generation workers are refitted. Pure: no Ray, no Prefect.

**Synchronous GRPO** (``grpo.async_grpo.enabled: false``, today's flow): step ``N`` generates on
the weights trained by step ``N-1`` (version ``N-1``); the workers are refitted after every train.

**Async GRPO** with age ``a = grpo.async_grpo.max_trajectory_age_steps`` (NeMo-RL's key): step
``N`` generates on version ``max(0, N-1-a)`` **exactly**, not "whatever is newest when the
generation starts", so a resumed or recomputed step reproduces its rollouts bit for bit. The
generation of later steps runs while step ``k`` trains, on the versions already refitted; the
refit of version ``k`` runs after ``train(k)`` and before ``train(k+1)`` (the policy then holds
exactly ``k``), once every generation on an older version is done. With ``a = 1``::

    generation  | gen 1 @v0 | gen 2 @v0     | refit v1 | gen 3 @v1     | refit v2 | gen 4 @v2     | ...
    policy      |           | train 1 -> v1 |  (send)  | train 2 -> v2 |  (send)  | train 3 -> v3 | ...

With ``a = 2`` the first three steps generate on ``v0`` (``gen 2`` and ``gen 3`` during
``train 1``), then one refit per step as above. ``trajectory_age(N) = (N-1) - version(N)``: 0 in
sync mode, ``min(a, N-1)`` in async mode.

Deviation from NeMo-RL: its async GRPO generates on the newest weights a background collector has
when it starts a batch (bounded by the age); here the version is a function of the step alone,
which is what makes an async run resumable to identical weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.config.master import MasterConfig

__all__ = ["Event", "StepSchedule"]


class Event(NamedTuple):
    """One unit of work: ``generate`` step ``step`` on ``version``; ``train`` step ``step`` (it
    produces version ``step``); ``refit`` the generation workers to ``version``."""

    kind: Literal["generate", "train", "refit"]
    step: int
    version: int

    @property
    def trains(self) -> bool:
        return self.kind == "train"

    @property
    def generates(self) -> bool:
        return self.kind == "generate"

    @property
    def refits(self) -> bool:
        return self.kind == "refit"


@dataclass(frozen=True)
class StepSchedule:
    """The schedule of steps ``1..max_steps``; ``age=None``: synchronous."""

    max_steps: int
    age: int | None = None

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.age is not None and self.age < 1:
            raise ValueError(f"the trajectory age must be >= 1 in async mode, got {self.age}")

    @classmethod
    def from_config(cls, cfg: MasterConfig) -> "StepSchedule":
        grpo = cfg.grpo
        a = grpo.async_grpo
        return cls(grpo.max_num_steps, a.max_trajectory_age_steps if a.enabled else None)

    @property
    def lookahead(self) -> int:
        """How many steps the generation may run ahead of the step being trained."""
        return self.age or 0

    def generation_version(self, step: int) -> int:
        """The weights version that generates the rollouts of ``step``.

        >>> [StepSchedule(5, 1).generation_version(n) for n in range(1, 6)]
        [0, 0, 1, 2, 3]
        >>> [StepSchedule(5).generation_version(n) for n in range(1, 6)]
        [0, 1, 2, 3, 4]
        """
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        return max(0, step - 1 - self.lookahead)

    def trajectory_age(self, step: int) -> int:
        """How many versions older than the trainer's (``step - 1``) the generating weights are."""
        return (step - 1) - self.generation_version(step)

    def phases(self) -> list[list[Event]]:
        """The run as a list of phases; the events of one phase may run at the same time (at most
        one ``train`` and the generations that overlap it, in step order on the generation
        workers), phases run one after another.

        >>> [[tuple(e) for e in p] for p in StepSchedule(3, 1).phases()]  # doctest: +NORMALIZE_WHITESPACE
        [[('generate', 1, 0)], [('train', 1, 1), ('generate', 2, 0)], [('refit', 1, 1)],
         [('train', 2, 2), ('generate', 3, 1)], [('train', 3, 3)]]
        """
        out: list[list[Event]] = []
        held, next_gen = 0, 1
        for k in range(1, self.max_steps + 1):
            if next_gen == k:  # nothing generated it ahead (the first step; every step in sync mode)
                out.append([Event("generate", k, held)])
                next_gen += 1
            phase = [Event("train", k, k)]
            while next_gen <= min(self.max_steps, k + self.lookahead) and self.generation_version(next_gen) == held:
                phase.append(Event("generate", next_gen, held))
                next_gen += 1
            out.append(phase)
            if next_gen <= self.max_steps and self.generation_version(next_gen) == k:
                out.append([Event("refit", k, k)])
                held = k
        return out

    def events(self) -> list[Event]:
        """:meth:`phases` flattened: one valid sequential order."""
        return [e for phase in self.phases() for e in phase]

    def timeline(self) -> str:
        """The phases as text, one line per phase (for logs and the README)."""
        names = {"generate": "gen {s} @v{v}", "train": "train {s} -> v{v}", "refit": "refit v{v}"}
        return "\n".join(" || ".join(names[e.kind].format(s=e.step, v=e.version) for e in p) for p in self.phases())
