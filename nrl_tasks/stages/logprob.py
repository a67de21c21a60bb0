"""``logprob`` stage: the policy's and the reference policy's logprobs of the rollouts.

Output columns: ``prev_logprobs [B, S]`` and ``reference_policy_logprobs [B, S]`` (float32,
NeMo-RL convention: position 0 is 0, position i holds ``log p(token_i | tokens_<i)``,
padding 0). With ``loss_fn.reference_policy_kl_penalty == 0`` the reference pass is skipped
and the column is a copy of ``prev_logprobs`` (the KL term is then exactly 0).
"""

from __future__ import annotations

from typing import Any

import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.common import TASK_DEFAULTS, StageTimer, committed, save_output, stage_task
from nrl_tasks.stages.faults import arm_actor_kill, fault_point
from nrl_tasks.stages.recovery import STAGE_RETRY, ensure_policy, stage_attempts

__all__ = ["compute_logprobs", "logprob"]


def compute_logprobs(policy: Any, rollouts: BatchedDataDict, *, need_reference: bool = True) -> BatchedDataDict:
    """``{"prev_logprobs", "reference_policy_logprobs"}`` of a rollout batch."""
    data = BatchedDataDict({"input_ids": rollouts["input_ids"], "input_lengths": rollouts["input_lengths"]})
    prev = policy.get_logprobs(data)["logprobs"].to(torch.float32)
    if need_reference:
        ref = policy.get_reference_policy_logprobs(data)["reference_logprobs"].to(torch.float32)
    else:
        ref = prev.clone()
    return BatchedDataDict({"prev_logprobs": prev, "reference_policy_logprobs": ref})


@stage_task(name="logprob", task_run_name="logprob-{run_id}-step{step}", **TASK_DEFAULTS, **STAGE_RETRY)
def logprob(cfg: Any, run_id: str, step: int, weights_version: int) -> dict[str, Any]:
    """Policy + reference logprobs of the step's rollouts (policy at ``weights_version``, restored
    first if its actors died); persist ``logprobs``."""
    import storage
    from flows.runtime import get_runtime

    rt = get_runtime(cfg, run_id)
    uri = rt.layout.stage_uri(step, "logprobs")
    if (done := committed(uri, rt.storage_options)) is not None:
        return {**done, "attempts": stage_attempts(skipped=True)}
    fault_point("logprob", step, "before")
    timer = StageTimer()
    ensure_policy(rt, cfg, weights_version)
    rollouts = storage.load_batch(rt.layout.stage_uri(step, "rollouts"), **rt.storage_kw)
    arm_actor_kill("policy", "logprob", step, rt.policy.worker_group.workers)
    with timer.phase("compute"):
        out = compute_logprobs(rt.policy, rollouts, need_reference=cfg.loss_fn.reference_policy_kl_penalty > 0)
    fault_point("logprob", step, "during")
    tokens = int(rollouts["input_lengths"].sum())
    res = save_output(
        out, uri, run_id=run_id, step=step, stage="logprobs", weights_version=weights_version,
        storage_options=rt.storage_options, fsync=cfg.storage.fsync, seconds=timer.total(),
        tokens_per_s=tokens / max(timer.seconds["compute"], 1e-9), compute_seconds=timer.seconds["compute"],
    )
    fault_point("logprob", step, "after")
    return {**res, "attempts": stage_attempts()}
