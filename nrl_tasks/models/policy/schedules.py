"""NeMo-RL's ``policy.scheduler`` as a list of torch LR schedulers joined at ``milestones``.

NeMo-RL writes::

    scheduler:
      - {name: torch.optim.lr_scheduler.LinearLR, kwargs: {start_factor: 0.1, end_factor: 1.0, total_iters: 50}}
      - {name: torch.optim.lr_scheduler.ConstantLR, kwargs: {factor: 1.0, total_iters: 10000000000}}
      - milestones: [50]

and builds ``torch.optim.lr_scheduler.SequentialLR`` from it. Here the policy's scheduler is a
``LambdaLR`` whose multiplier is a function of the step count alone (its checkpoint state is
``last_epoch``; :mod:`nrl_tasks.models.policy.workers.optim`), so :meth:`TorchSchedule.factor`
runs torch's own schedulers on a one-parameter SGD optimizer at lr 1.0 and reads the learning
rate after ``step`` steps: the same multipliers as NeMo-RL's, from torch's code, with no
scheduler object to save. Multipliers are computed once per schedule and kept.
"""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import Field, PrivateAttr, model_validator

from nrl_tasks.config.base import Section

__all__ = ["SCHEDULERS", "TorchSchedule", "TorchSchedulerEntry", "from_nemo_rl_list"]

SCHEDULERS = ("ConstantLR", "CosineAnnealingLR", "ExponentialLR", "LinearLR", "MultiStepLR", "PolynomialLR", "StepLR")
"""torch's schedulers whose rate depends on the step count alone (not on a metric or a callable)."""
_PREFIX = "torch.optim.lr_scheduler."


class TorchSchedulerEntry(Section):
    """One of torch's LR schedulers: ``name`` (``torch.optim.lr_scheduler.LinearLR`` or ``LinearLR``) and its kwargs."""

    name: str
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known(self) -> "TorchSchedulerEntry":
        short = self.name.removeprefix(_PREFIX)
        if short not in SCHEDULERS:
            raise ValueError(f"scheduler {self.name!r} is not one of {', '.join(_PREFIX + s for s in SCHEDULERS)}")
        return self


class TorchSchedule(Section):
    """Schedulers run one after another, the next starting at each of ``milestones`` (optimizer steps)."""

    schedulers: list[TorchSchedulerEntry] = Field(min_length=1, max_length=16)
    milestones: list[int] = Field(default_factory=list)
    _factors: list[float] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> "TorchSchedule":
        if len(self.milestones) != len(self.schedulers) - 1:
            raise ValueError(f"{len(self.schedulers)} schedulers need {len(self.schedulers) - 1} milestones, "
                             f"got {self.milestones}")
        if any(b <= a for a, b in zip(self.milestones, self.milestones[1:])) or any(m < 1 for m in self.milestones):
            raise ValueError(f"milestones must be positive and increasing, got {self.milestones}")
        try:
            self._simulate(2)  # torch checks the kwargs: a wrong name or value is an error now
        except (TypeError, ValueError) as exc:
            raise ValueError(f"scheduler kwargs: {exc}") from None
        return self

    def factor(self, step: int) -> float:
        """LR multiplier after ``step`` optimizer steps (0-based), as torch's schedulers give it."""
        if step >= len(self._factors):
            self._factors = self._simulate(max(step + 1, 2 * len(self._factors), 64))
        return self._factors[step]

    def _simulate(self, steps: int) -> list[float]:
        import torch

        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": nothing is trained here
            built = [getattr(torch.optim.lr_scheduler, e.name.removeprefix(_PREFIX))(opt, **e.kwargs) for e in self.schedulers]
            sched = built[0] if len(built) == 1 else torch.optim.lr_scheduler.SequentialLR(opt, built, self.milestones)
            out = [opt.param_groups[0]["lr"]]
            for _ in range(steps - 1):
                opt.step()
                sched.step()
                out.append(opt.param_groups[0]["lr"])
        return out


def from_nemo_rl_list(value: Any) -> Any:
    """NeMo-RL's list form (schedulers, then an item holding only ``milestones``) as a
    :class:`TorchSchedule`'s data; any other value unchanged.

    >>> from_nemo_rl_list([{"name": "LinearLR", "kwargs": {"total_iters": 5}}, {"name": "ConstantLR"}, {"milestones": [5]}])
    {'schedulers': [{'name': 'LinearLR', 'kwargs': {'total_iters': 5}}, {'name': 'ConstantLR'}], 'milestones': [5]}
    """
    if not isinstance(value, list):
        return value
    items = [v for v in value if not (isinstance(v, dict) and set(v) == {"milestones"})]
    marks = [v["milestones"] for v in value if isinstance(v, dict) and set(v) == {"milestones"}]
    return {"schedulers": items, "milestones": marks[-1] if marks else []}
