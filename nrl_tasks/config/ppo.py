"""NeMo-RL's ``ppo`` section: a config with it is a PPO run with a value model (``nrl ppo``,
:mod:`flows.algorithms.ppo`).

The keys are NeMo-RL's (``examples/configs/ppo_math_1B.yaml``). The sampling keys mean what
GRPO's do (the stages that sample, score and validate read whichever section the run has:
``MasterConfig.rollout``); ``ppo_epochs`` passes over each step's batch train the value model and
then the policy; the first ``policy_training_start_step`` steps train the value model alone
(critic warm-up). Advantages are GAE's (``adv_estimator``, :mod:`nrl_tasks.algorithms.gae`). The
value model is the ``value`` section (a policy config: NeMo-RL's sets ``model_name:
${policy.model_name}``; absent, it is the policy's model and settings) with a one-output head,
trained with ``value_loss_fn`` (:mod:`nrl_tasks.algorithms.value_loss`).

Accepted but only in their off state (refused otherwise, naming the key, by
:mod:`nrl_tasks.config.combinations`): ``async_ppo.enabled``, ``use_dynamic_sampling`` (and
``batch_multiplier`` 1), ``overlong_filtering``, ``seq_logprob_error_threshold``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nrl_tasks.algorithms.reward_shaping import RewardShapingConfig
from nrl_tasks.config.base import Section
from nrl_tasks.config.bounds import INT64, MAX_DATASET_ROWS, MAX_PROMPTS, MAX_ROWS, MAX_STEPS
from nrl_tasks.config.grpo import RewardScalingConfig

__all__ = ["AsyncPPOConfig", "GAEConfig", "PPOConfig"]


class GAEConfig(Section):
    """NeMo-RL's ``ppo.adv_estimator`` (GAE, with VAPO's decoupled lambdas)."""

    name: Literal["gae"] = "gae"
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0)
    gae_gamma: float = Field(1.0, ge=0.0, le=1.0)
    normalize_advantages: bool = True
    gae_lambda_value: float | None = Field(None, ge=0.0, le=1.0, description="VAPO: the returns' lambda (null: gae_lambda)")
    gae_lambda_policy: float | None = Field(None, ge=0.0, le=1.0, description="VAPO: the advantages' lambda (null: gae_lambda)")
    length_adaptive_alpha: float = Field(0.0, ge=0.0, le=1e6, description="VAPO: the advantages' lambda is "
                                         "1 - 1/(alpha * response length) per sample (0: off)")


class AsyncPPOConfig(Section):
    """NeMo-RL's ``ppo.async_ppo``: only ``enabled: false`` runs here (PPO is synchronous)."""

    enabled: bool = False
    max_trajectory_age_steps: int = Field(1, ge=1, le=1000)
    warmup_generation_lead_steps: int | None = None
    in_flight_weight_updates: bool = False
    recompute_kv_cache_after_weight_updates: bool = False
    drop_incomplete_targets_on_restore: bool = False


class PPOConfig(Section):
    """NeMo-RL's ``ppo`` keys (see the module docstring)."""

    num_prompts_per_step: int = Field(8, ge=1, le=MAX_PROMPTS, description="<= 65536")
    num_generations_per_prompt: int = Field(4, ge=1, le=1024, description="samples per prompt")
    max_rollout_turns: int = Field(1, ge=1, le=1024, description="turns of a multi-turn episode (env.environment)")
    max_num_steps: int = Field(10, ge=1, le=MAX_STEPS, description="<= 10**7")
    max_num_epochs: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="NeMo-RL's key: the run ends after the fewer of max_num_steps and "
        "max_num_epochs * (train prompts // num_prompts_per_step) steps (null: max_num_steps alone)",
    )
    ppo_epochs: int = Field(4, ge=1, le=1000, description="passes over each step's batch (value model, then policy)")
    policy_training_start_step: int = Field(0, ge=0, le=MAX_STEPS, description="steps that train the value model alone "
                                            "(critic warm-up) before the policy trains")
    val_period: int = Field(0, ge=0, le=MAX_STEPS, description="validate every N steps (0: never)")
    val_at_start: bool = False
    val_at_end: bool = Field(False, description="also validate after the run's last step")
    overlong_filtering: bool = Field(False, description="not built for PPO: only false")
    max_val_samples: int = Field(32, ge=1, le=MAX_DATASET_ROWS, description="<= 10**8")
    val_batch_size: int = Field(32, ge=1, le=MAX_ROWS, description="<= 2**20")
    seed: int = Field(42, ge=INT64[0], le=INT64[1], description="draw of each step's prompts and samples")
    use_dynamic_sampling: bool = Field(False, description="not built for PPO: only false")
    dynamic_sampling_max_gen_batches: int = Field(10, ge=1, le=1000, description="read with use_dynamic_sampling only")
    batch_multiplier: int = Field(1, ge=1, le=1024, description="read with use_dynamic_sampling only: only 1")
    skip_reference_policy_logprobs_calculation: bool = Field(
        False, description="the reference policy's logprobs are computed only when a KL term reads them "
        "(loss_fn.reference_policy_kl_penalty > 0); true with such a term is refused")
    async_ppo: AsyncPPOConfig = Field(default_factory=AsyncPPOConfig)
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    adv_estimator: GAEConfig = Field(default_factory=GAEConfig)
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    seq_logprob_error_threshold: float | None = Field(None, description="not built for PPO: only null")
