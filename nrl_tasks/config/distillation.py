"""NeMo-RL's ``distillation`` section: a config with it is an on-policy distillation run
(``nrl distill``, :mod:`flows.algorithms.distill`).

The keys are NeMo-RL's (``examples/configs/distillation_math.yaml``): how many prompts and samples
a step draws, how long the run is, the validation cadence and size, the teacher's top-k width, the
seed. The student is ``policy``; the teacher is the ``teacher`` section (a policy config: its
``model_name`` at least; it runs without an optimizer) and must share the student's vocabulary.
The loss keys live in ``loss_fn`` (:class:`~nrl_tasks.algorithms.distillation.DistillationLossConfig`).
"""

from __future__ import annotations

from pydantic import Field

from nrl_tasks.config.base import Section
from nrl_tasks.config.bounds import INT64, MAX_DATASET_ROWS, MAX_PROMPTS, MAX_ROWS, MAX_STEPS

__all__ = ["DistillationConfig"]


class DistillationConfig(Section):
    """NeMo-RL's ``distillation`` keys (see the module docstring). The sampling keys have the
    names and meaning of GRPO's: the stages that sample and validate read whichever section the
    run has (``MasterConfig.rollout``)."""

    num_prompts_per_step: int = Field(8, ge=1, le=MAX_PROMPTS, description="prompts drawn per step, <= 65536")
    num_generations_per_prompt: int = Field(1, ge=1, le=1024, description="student samples per prompt")
    max_rollout_turns: int = Field(1, ge=1, le=1000, description="turns of a multi-turn episode (env.environment)")
    max_num_steps: int = Field(10, ge=1, le=MAX_STEPS, description="optimizer steps, <= 10**7")
    max_num_epochs: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="NeMo-RL's key: the run ends after the fewer of max_num_steps and "
        "max_num_epochs * (train prompts // num_prompts_per_step) steps (null: max_num_steps alone)",
    )
    val_batch_size: int = Field(32, ge=1, le=MAX_ROWS, description="prompts generated at a time in validation")
    val_period: int = Field(0, ge=0, le=MAX_STEPS, description="validate every N steps (0: never)")
    val_at_start: bool = False
    val_at_end: bool = Field(False, description="also validate after the run's last step")
    max_val_samples: int = Field(32, ge=1, le=MAX_DATASET_ROWS, description="held-out prompts per validation")
    topk_logits_k: int = Field(64, ge=1, le=65_536, description="the teacher's top-k logits kept per token")
    seed: int = Field(42, ge=INT64[0], le=INT64[1], description="draw of each step's prompts and samples")
