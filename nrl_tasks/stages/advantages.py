"""``advantages`` stage: advantages from the persisted rewards (``grpo.adv_estimator.name``).

A group is the ``num_generations_per_prompt`` rows sharing a ``group_id``.

- ``grpo``: leave-one-out baseline and std normalisation per ``grpo.use_leave_one_out_baseline``
  and ``grpo.normalize_rewards``; ``advantages [B]`` float32, one per sample (the train stage
  broadcasts it over the response tokens);
- ``dr_grpo``: the group mean subtracted, no leave-one-out, no std division; ``[B]``;
- ``reinforce_plus_plus`` (:mod:`nrl_tasks.algorithms.advantage_estimators`): ``advantages [B, S]``
  float32 per token; with ``loss_fn.use_kl_in_reward`` the stage also reads the step's
  ``logprobs`` (the KL of ``prev_logprobs`` to ``reference_policy_logprobs`` goes into the reward).

NeMo-RL's ``grpo.advantage_clip_low`` / ``advantage_clip_high`` clamp the advantages after that.

Also ``sample_mask [B]`` float32 (0 for samples whose reward is invalid, and with
``grpo.overlong_filtering`` for truncated ones) and, when the loss adds
VAPO's positive-example NLL (``loss_fn.positive_example_nll_weight > 0``), ``rewards [B]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from prefect import task

from nrl_tasks.algorithms.utils import calculate_kl, compute_grpo_advantages
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, run_stage
from nrl_tasks.stages.train import finite_or_none

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.algorithms.loss_functions import ClippedPGLossConfig
    from nrl_tasks.config.grpo import GRPOConfig
    from nrl_tasks.config.master import MasterConfig

__all__ = ["advantages", "compute_advantages", "needs_logprobs"]


def compute_advantages(
    group_id: torch.Tensor,
    rewards: torch.Tensor,
    valid: torch.Tensor,
    grpo_cfg: GRPOConfig,
    *,
    loss_cfg: ClippedPGLossConfig | None = None,
    token_mask: torch.Tensor | None = None,
    logprobs: Any = None,
    truncated: torch.Tensor | None = None,
) -> BatchedDataDict:
    """``{"advantages" [B] or [B, S], "sample_mask" [B]}`` (float32; see the module docstring);
    ``truncated [B]``: the rollouts' flag, read with ``grpo.overlong_filtering``."""

    est = grpo_cfg.adv_estimator
    if est.name == "reinforce_plus_plus":
        from nrl_tasks.algorithms.advantage_estimators import reinforce_plus_plus_advantages

        if token_mask is None:
            raise ValueError("grpo.adv_estimator.name=reinforce_plus_plus needs the rollouts' token_mask")
        kl = None
        if loss_cfg is not None and loss_cfg.use_kl_in_reward:
            if logprobs is None:
                raise ValueError("loss_fn.use_kl_in_reward needs the step's logprobs (prev and reference)")
            kl = loss_cfg.reference_policy_kl_penalty * calculate_kl(
                logprobs["prev_logprobs"].double(), logprobs["reference_policy_logprobs"].double(), loss_cfg.reference_policy_kl_type
            )
        adv = reinforce_plus_plus_advantages(
            group_id, rewards.to(torch.float32), valid.to(torch.float32), token_mask,
            minus_baseline=est.minus_baseline, kl_penalty=kl,
        )
    else:
        dr = est.name == "dr_grpo"  # group mean, no std division
        adv = compute_grpo_advantages(
            group_id,
            rewards.to(torch.float32),
            valid.to(torch.float32),
            leave_one_out_baseline=False if dr else grpo_cfg.use_leave_one_out_baseline,
            normalize_rewards=False if dr else grpo_cfg.normalize_rewards,
            std_epsilon=est.std_epsilon,
        ).to(torch.float32)
    lo, hi = grpo_cfg.advantage_clip_low, grpo_cfg.advantage_clip_high
    if lo is not None or hi is not None:
        adv = adv.clamp(min=lo, max=hi)  # after normalisation, as NeMo-RL
    mask = valid.to(torch.float32)
    if grpo_cfg.overlong_filtering:  # truncated samples: in their group's baseline above, out of the loss
        if truncated is None:
            raise ValueError("grpo.overlong_filtering needs the rollouts' truncated column")
        mask = mask * (~truncated.to(torch.bool)).to(torch.float32)
    out = {"advantages": adv, "sample_mask": mask}
    if loss_cfg is not None and loss_cfg.positive_example_nll_weight > 0:
        out["rewards"] = torch.where(valid.bool(), rewards.to(torch.float32), torch.zeros_like(rewards, dtype=torch.float32))
    return BatchedDataDict(out)


def needs_logprobs(cfg: MasterConfig) -> bool:
    """Whether the run's ``advantages`` stage reads the step's ``logprobs`` (REINFORCE++ with the KL in the reward)."""
    return bool(cfg.loss_fn.use_kl_in_reward)


@task(name="advantages", task_run_name="advantages-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def advantages(ctx: StepContext, rollouts: DatasetRef, rewards: DatasetRef, logprobs: DatasetRef | None = None) -> DatasetRef:
    """The step's advantages; persist ``advantages`` (``logprobs``: see :func:`needs_logprobs`)."""
    cfg = ctx.cfg

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        groups = inputs["rollouts"]["group_id"]
        r, valid = inputs["rewards"]["rewards"], inputs["rewards"]["reward_valid"]
        per_token = cfg.grpo.adv_estimator.name == "reinforce_plus_plus"  # GRPO's advantages need no token mask
        out = compute_advantages(
            groups, r, valid, cfg.grpo, loss_cfg=cfg.loss_fn,
            token_mask=inputs["rollouts"]["token_mask"] if per_token else None, logprobs=inputs.get("logprobs"),
            truncated=inputs["rollouts"]["truncated"] if cfg.grpo.overlong_filtering else None,
        )
        mixed = sum(int(r[groups == g].unique().numel() > 1) for g in groups.unique().tolist())
        figures = {"groups_with_signal": mixed, "advantage_abs_mean": float(out["advantages"].double().abs().mean())}
        return out, finite_or_none(figures, f"advantages of step {ctx.step}")

    inputs = {"rollouts": rollouts, "rewards": rewards, **({"logprobs": logprobs} if logprobs is not None else {})}
    return run_stage(ctx, "advantages", compute, inputs=inputs)
