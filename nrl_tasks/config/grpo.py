"""The algorithm sections of the run config: ``grpo`` (with its refit, async, advantage-estimator and
reward-shaping subsections) and ``warm_start``. Keys keep NeMo-RL's names where they exist."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from nrl_tasks.algorithms.reward_shaping import RewardShapingConfig
from nrl_tasks.config.advantages import AdvEstimatorConfig
from nrl_tasks.config.async_grpo import AsyncGRPOConfig
from nrl_tasks.config.base import Section
from nrl_tasks.config.bounds import (  # the maxima, named (``le=`` below) and checked by ``value_errors``
    INT64, MAX_DATASET_ROWS, MAX_PROMPTS, MAX_RETRIES, MAX_ROWS, MAX_SECONDS, MAX_STEPS, check_delays,
)
from nrl_tasks.stages.errors import DEFAULT_STAGE_RETRIES, DEFAULT_STAGE_RETRY_DELAY_S

__all__ = ["GRPOConfig", "RefitConfig", "RewardScalingConfig", "WarmStartConfig"]


class RefitConfig(Section):
    """How weights move from the Policy to the generation workers after each ``train``."""

    timeout_s: float = Field(
        120.0, gt=0, le=MAX_SECONDS, description="hard deadline of one refit attempt (s, <= 1 day)"
    )
    retries: int = Field(3, ge=0, le=MAX_RETRIES, description="Prefect retries of the refit task (<= 100)")
    retry_delay_s: list[float] = Field(default_factory=lambda: [1.0, 2.0, 4.0], description="backoff (s)")
    verify_checksum: bool = Field(False, description="debug: compare generation weights checksums after refit")

    _delays = field_validator("retry_delay_s")(check_delays)


class RewardScalingConfig(Section):
    """NeMo-RL's ``grpo.reward_scaling``: each valid reward clamped to ``[source_min, source_max]``,
    then mapped linearly onto ``[target_min, target_max]`` (before reward shaping and advantages)."""

    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0

    @model_validator(mode="after")
    def _range(self) -> "RewardScalingConfig":
        if self.enabled and not self.source_max > self.source_min:
            raise ValueError(f"grpo.reward_scaling.source_max ({self.source_max}) must exceed source_min ({self.source_min})")
        return self


class GRPOConfig(Section):
    num_prompts_per_step: int = Field(8, ge=1, le=MAX_PROMPTS, description="<= 65536")
    num_generations_per_prompt: int = Field(
        4, ge=2, le=1024, description="group size; >= 2 for GRPO advantages, <= 1024 (and prompts * group <= 2**20)"
    )
    max_num_steps: int = Field(10, ge=1, le=MAX_STEPS, description="<= 10**7")
    max_num_epochs: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="NeMo-RL's key: the run ends after the fewer of max_num_steps and "
        "max_num_epochs * (train prompts // num_prompts_per_step) steps (null: max_num_steps alone)",
    )
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = True
    val_period: int = Field(0, ge=0, le=MAX_STEPS, description="validate every N steps (0: never)")
    val_at_start: bool = False
    val_at_end: bool = Field(False, description="NeMo-RL's key: also validate after the run's last step")
    overlong_filtering: bool = Field(
        False, description="NeMo-RL's key: truncated responses (they hit the token limit) count in their group's "
        "baseline but not in the loss (sample mask 0)",
    )
    advantage_clip_low: float | None = Field(None, description="NeMo-RL's key: advantages below are clamped to it")
    advantage_clip_high: float | None = Field(None, description="NeMo-RL's key: advantages above are clamped to it")
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    stop_at_validation_metric: Literal["accuracy"] | None = Field(
        None, description="NeMo-RL's key: end the run after the first validation whose metric (`accuracy`: the "
        "metrics column val_accuracy) reaches stop_at_validation_threshold; that step saves a checkpoint (null: off)",
    )
    stop_at_validation_threshold: float | None = Field(
        None, description="NeMo-RL's key: the early stop's threshold (>=), required with stop_at_validation_metric",
    )
    max_val_samples: int = Field(32, ge=1, le=MAX_DATASET_ROWS, description="<= 10**8")
    val_batch_size: int = Field(32, ge=1, le=MAX_ROWS, description="<= 2**20")
    seed: int = Field(42, ge=INT64[0], le=INT64[1], description="any 64-bit signed integer")
    stage_retries: int = Field(
        DEFAULT_STAGE_RETRIES, ge=0, le=MAX_RETRIES,
        description="Prefect retries of a stage that calls actors (generate, logprob, train, checkpoint, "
        "validate) after an actor fault; 0: the first fault fails the run; <= 100",
    )
    max_steps_without_valid_reward: int = Field(
        1, ge=0, le=MAX_STEPS,
        description="consecutive steps whose rewards are all invalid (NaN, inf, raised) that are masked and "
        "trained past; the next one stops the run naming the reward source (0: the first stops it)",
    )
    stage_retry_delay_s: list[float] = Field(
        default_factory=lambda: list(DEFAULT_STAGE_RETRY_DELAY_S),
        description="backoff before each stage retry (s, each <= 1 day, at most 50); the last value repeats",
    )
    refit: RefitConfig = Field(default_factory=RefitConfig)
    async_grpo: AsyncGRPOConfig = Field(default_factory=AsyncGRPOConfig)
    adv_estimator: AdvEstimatorConfig = Field(default_factory=AdvEstimatorConfig)
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    use_dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: train only on groups whose rewards differ, generating more "
        "batches until num_prompts_per_step such groups are found (nrl_tasks.algorithms.dynamic_sampling)",
    )
    batch_multiplier: int = Field(
        1, ge=1, le=1024, description="dynamic sampling: each generation batch draws batch_multiplier * "
        "num_prompts_per_step prompts; <= 1024",
    )
    dynamic_sampling_max_gen_batches: int = Field(
        10, ge=1, le=1000, description="dynamic sampling: generation batches per step before the step fails; <= 1000",
    )
    max_rollout_turns: int = Field(
        1, ge=1, le=1024, description="NeMo-RL's key: turns per episode with env.environment (generate, the "
        "environment answers, generate again: nrl_tasks.stages.multi_turn); 1: single-turn; <= 1024",
    )

    _delays = field_validator("stage_retry_delay_s")(check_delays)

    @model_validator(mode="after")
    def _clip_bounds(self) -> "GRPOConfig":
        lo, hi = self.advantage_clip_low, self.advantage_clip_high
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"grpo.advantage_clip_low ({lo}) exceeds grpo.advantage_clip_high ({hi})")
        if self.stop_at_validation_metric is not None:
            if self.stop_at_validation_threshold is None:
                raise ValueError("grpo.stop_at_validation_threshold must be set when grpo.stop_at_validation_metric is")
            if not (self.val_period or self.val_at_end):
                raise ValueError("grpo.stop_at_validation_metric needs validations to read: set grpo.val_period > 0 "
                                 "(or grpo.val_at_end)")
        return self


class WarmStartConfig(Section):
    """A supervised warm start the GRPO flow runs first (not a NeMo-RL key; :mod:`flows.algorithms.warm_start`)."""

    sft_steps: int = Field(0, ge=0, le=100_000, description="SFT steps on the reference answers before GRPO (0: none)")
    batch_size: int = Field(32, ge=1, le=65_536, description="prompts per SFT step")
    lr: float | None = Field(None, gt=0, le=1.0, description="SFT learning rate (default policy.optimizer.kwargs.lr)")
