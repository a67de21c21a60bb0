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

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.common import TASK_DEFAULTS, StageTimer, committed, save_output, stage_task
from nrl_tasks.stages.faults import fault_point

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


@stage_task(name="advantages", task_run_name="advantages-{run_id}-step{step}", **TASK_DEFAULTS)
def advantages(cfg: Any, run_id: str, step: int) -> dict[str, Any]:
    """GRPO advantages of the step; persist ``advantages``."""
    import storage
    from flows.runtime import get_runtime

    rt = get_runtime(cfg, run_id)
    uri = rt.layout.stage_uri(step, "advantages")
    if (done := committed(uri, rt.storage_options)) is not None:
        return done
    fault_point("advantages", step, "before")
    timer = StageTimer()
    rollouts = storage.load_batch(rt.layout.stage_uri(step, "rollouts"), **rt.storage_kw)
    rewards = storage.load_batch(rt.layout.stage_uri(step, "rewards"), **rt.storage_kw)
    out = compute_advantages(rollouts["group_id"], rewards["rewards"], rewards["reward_valid"], cfg.grpo)
    fault_point("advantages", step, "during")
    groups = rollouts["group_id"]
    r = rewards["rewards"]
    mixed = sum(int(r[groups == g].unique().numel() > 1) for g in groups.unique().tolist())
    res = save_output(
        out, uri, run_id=run_id, step=step, stage="advantages", weights_version=None,
        storage_options=rt.storage_options, fsync=cfg.storage.fsync, seconds=timer.total(),
        groups_with_signal=mixed, advantage_abs_mean=float(out["advantages"].abs().mean()),
    )
    fault_point("advantages", step, "after")
    return res
