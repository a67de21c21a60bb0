"""``grpo.adv_estimator`` (NeMo-RL's key): which advantage estimator the ``advantages`` stage runs.

- ``grpo`` (default): group-relative, leave-one-out baseline and std normalisation per
  ``grpo.use_leave_one_out_baseline`` / ``grpo.normalize_rewards`` (DeepSeekMath's GRPO with
  RLOO's baseline);
- ``reinforce_plus_plus``: REINFORCE++ (https://arxiv.org/abs/2501.03262): the group mean
  subtracted when ``minus_baseline`` (NeMo-RL's default, "REINFORCE++-baseline"), the KL penalty
  moved into the per-token reward with ``loss_fn.use_kl_in_reward``, then one normalisation over
  every valid token of the batch;
- ``dr_grpo``: Dr. GRPO (https://arxiv.org/abs/2503.20783): ``r_i - mean_{j in g} r_j``, no
  leave-one-out, no std division (pair it with ``loss_fn.constant_length_normalization``).

``std_epsilon`` (not a NeMo-RL key; NeMo-RL fixes it at 1e-6): ``grpo``'s advantage is
``(r - baseline) / (std + std_epsilon)``. TRL's ``GRPOTrainer`` adds 1e-4; set ``1.0e-4`` to match it
(``configs/grpo_smollm2_vs_trl.yaml``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nrl_tasks.config.base import Section

__all__ = ["AdvEstimatorConfig"]


class AdvEstimatorConfig(Section):
    name: Literal["grpo", "reinforce_plus_plus", "dr_grpo"] = "grpo"
    #: REINFORCE++: subtract the group mean (the prompt's samples) before the batch normalisation
    minus_baseline: bool = True
    #: ``grpo``: added to the group std before the division (NeMo-RL: 1e-6; TRL's GRPOTrainer: 1e-4)
    std_epsilon: float = Field(1e-6, gt=0.0, le=1.0, description="grpo: A = (r - baseline) / (std + std_epsilon)")
