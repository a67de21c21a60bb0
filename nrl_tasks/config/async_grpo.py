"""NeMo-RL's ``grpo.async_grpo`` section (the schedule itself: :mod:`nrl_tasks.stages.schedule`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from nrl_tasks.config.base import Section

__all__ = ["AsyncGRPOConfig"]


class AsyncGRPOConfig(Section):
    """NeMo-RL's ``grpo.async_grpo``: generation of later steps overlaps training of this one.

    Rollouts of step ``N`` are generated on weights version ``max(0, N - 1 - age)`` exactly
    (:mod:`nrl_tasks.stages.schedule`), so a resumed or recomputed step reproduces them."""

    enabled: bool = False
    max_trajectory_age_steps: int = Field(
        1, ge=1, le=1024, description="how many steps older than the trainer the generating weights are (>= 1)"
    )
    in_flight_weight_updates: bool = Field(
        False, description="not implemented here: weights change only between generations (must stay false)"
    )

    @model_validator(mode="after")
    def _check(self) -> "AsyncGRPOConfig":
        if self.in_flight_weight_updates:
            raise ValueError(
                "grpo.async_grpo.in_flight_weight_updates is not implemented: a generation runs on one weights "
                "version from start to end (set it to false)"
            )
        return self
