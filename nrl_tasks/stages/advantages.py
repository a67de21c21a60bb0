"""``advantages`` stage: GRPO group-relative advantages from the persisted rewards.

A group is the ``num_generations_per_prompt`` rows sharing a ``group_id``. Leave-one-out
baseline and std normalisation per ``grpo.use_leave_one_out_baseline`` and
``grpo.normalize_rewards``. Output columns: ``advantages [B]`` float32 (one per sample;
the train stage broadcasts it over the response tokens) and ``sample_mask [B]`` float32
(0 for samples whose reward is invalid).
"""

from __future__ import annotations

from typing import Any

import torch

from prefect import task

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, run_stage
from nrl_tasks.stages.train import finite_or_none

__all__ = ["advantages", "compute_advantages"]


def compute_advantages(group_id: torch.Tensor, rewards: torch.Tensor, valid: torch.Tensor, grpo_cfg: Any) -> BatchedDataDict:
    """``{"advantages" [B], "sample_mask" [B]}`` (float32)."""
    from nrl_tasks.algorithms.utils import compute_grpo_advantages

    adv = compute_grpo_advantages(
        group_id,
        rewards.to(torch.float32),
        valid.to(torch.float32),
        leave_one_out_baseline=grpo_cfg.use_leave_one_out_baseline,
        normalize_rewards=grpo_cfg.normalize_rewards,
    )
    return BatchedDataDict({"advantages": adv.to(torch.float32), "sample_mask": valid.to(torch.float32)})


@task(name="advantages", task_run_name="advantages-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def advantages(ctx: StepContext, rollouts: DatasetRef, rewards: DatasetRef) -> DatasetRef:
    """GRPO advantages of the step; persist ``advantages``."""

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        groups = inputs["rollouts"]["group_id"]
        r, valid = inputs["rewards"]["rewards"], inputs["rewards"]["reward_valid"]
        out = compute_advantages(groups, r, valid, ctx.cfg.grpo)
        mixed = sum(int(r[groups == g].unique().numel() > 1) for g in groups.unique().tolist())
        figures = {"groups_with_signal": mixed, "advantage_abs_mean": float(out["advantages"].double().abs().mean())}
        return out, finite_or_none(figures, f"advantages of step {ctx.step}")

    return run_stage(ctx, "advantages", compute, inputs={"rollouts": rollouts, "rewards": rewards})
