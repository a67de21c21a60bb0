"""NeMo-RL's ``rm`` section: a config with it is a reward-model training run (``nrl rm``,
:mod:`flows.algorithms.rm`).

The keys are NeMo-RL's (``examples/configs/rm.yaml``): the run's length, the validation cadence
and size, the seed of the draw. The model is ``policy.model_name`` loaded as a one-output sequence
classifier (``policy.reward_model_cfg.enabled: true``, which an RM run needs: NeMo-RL's file sets
it; a causal LM's folder gets a new head), trained with the Bradley-Terry loss
(:mod:`nrl_tasks.algorithms.reward_model`) on the same preference pairs DPO reads
(``data.train_path`` rows ``prompt``, ``chosen``, ``rejected``, or the built-in task's pairs). As
in NeMo-RL, ``policy.train_global_batch_size`` counts pairs. Its checkpoints' ``weights`` folders
load as GRPO's ``env.reward_model.model_name``.
"""

from __future__ import annotations

from pydantic import Field

from nrl_tasks.config.bounds import INT64, MAX_STEPS
from nrl_tasks.config.sft import SupervisedValidation

__all__ = ["RMConfig"]


class RMConfig(SupervisedValidation):
    """NeMo-RL's ``rm`` keys (see the module docstring); validation: held-out pair accuracy, loss
    and margin (:class:`~nrl_tasks.config.sft.SupervisedValidation`)."""

    max_num_steps: int = Field(20, ge=1, le=MAX_STEPS, description="optimizer steps, <= 10**7")
    max_num_epochs: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="NeMo-RL's key: the run ends after the fewer of max_num_steps and "
        "max_num_epochs * (train pairs // policy.train_global_batch_size) steps (null: max_num_steps alone)",
    )
    seed: int = Field(42, ge=INT64[0], le=INT64[1], description="draw of each step's pairs")
