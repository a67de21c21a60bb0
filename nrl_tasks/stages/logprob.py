"""``logprob`` stage: the policy's and the reference policy's logprobs of the rollouts.

Output columns: ``prev_logprobs [B, S]`` and ``reference_policy_logprobs [B, S]`` (float32,
NeMo-RL convention: position 0 is 0, position i holds ``log p(token_i | tokens_<i)``,
padding 0). With ``loss_fn.reference_policy_kl_penalty == 0`` the reference pass is skipped
and the column is a copy of ``prev_logprobs`` (the KL term is then exactly 0).

When nothing reads them (:func:`logprob_needed` is false: ``loss_fn.force_on_policy_ratio``, no
KL term in the loss or the reward; the config allows that ratio only with one optimizer step per
rollout batch) the stage does not run at all: the step has no ``logprobs`` dataset, ``train`` and
its replays do without, and the metrics line says ``logprob_skipped: true``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from prefect import task

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.errors import StalePolicyError
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, run_stage

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.config.master import MasterConfig
    from nrl_tasks.models.policy.interfaces import PolicyInterface

__all__ = ["check_policy_version", "compute_logprobs", "logprob", "logprob_needed", "reference_needed"]


def logprob_needed(cfg: MasterConfig) -> bool:
    """Whether any stage reads the step's ``logprobs`` (see the module docstring)."""
    loss = cfg.loss_fn
    return not (loss.force_on_policy_ratio and loss.kl_in_loss == 0 and not loss.use_kl_in_reward)


def reference_needed(cfg: MasterConfig) -> bool:
    """Whether the step reads the reference policy's logprobs (a KL term against it, in the loss or
    the reward): else the policy workers need not keep the initial weights at all."""
    return cfg.loss_fn.reference_policy_kl_penalty > 0


def compute_logprobs(policy: PolicyInterface, rollouts: BatchedDataDict, *, need_reference: bool = True) -> BatchedDataDict:
    """``{"prev_logprobs", "reference_policy_logprobs"}`` of a rollout batch."""
    data = BatchedDataDict({"input_ids": rollouts["input_ids"], "input_lengths": rollouts["input_lengths"]})
    if "token_mask" in rollouts:  # where the prompts end: the policy runs a shared prompt once
        data["token_mask"] = rollouts["token_mask"]
    prev = policy.get_logprobs(data)["logprobs"].to(torch.float32)
    if need_reference:
        ref = policy.get_reference_policy_logprobs(data)["reference_logprobs"].to(torch.float32)
    else:
        ref = prev.clone()
    return BatchedDataDict({"prev_logprobs": prev, "reference_policy_logprobs": ref})


def check_policy_version(policy: PolicyInterface, version: int, what: str) -> None:
    """``StalePolicyError`` unless the policy reports weights version ``version``."""
    have = policy.weights_version
    if have != version:
        raise StalePolicyError(f"{what} needs the policy at weights version {version}, it holds {have}")


@task(name="logprob", task_run_name="logprob-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def logprob(ctx: StepContext, rollouts: DatasetRef, weights_version: int) -> DatasetRef:
    """Policy + reference logprobs of the step's rollouts (policy at ``weights_version``); persist ``logprobs``."""

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        batch = inputs["rollouts"]
        policy = ctx.policy
        check_policy_version(policy, weights_version, f"logprob of step {ctx.step}")
        ctx.actor_call("logprob", "policy", policy.worker_group.workers)
        with timer.phase("compute"):
            out = compute_logprobs(policy, batch, need_reference=reference_needed(ctx.cfg))
        tokens = int(batch["input_lengths"].sum())
        return out, {"tokens_per_s": tokens / max(timer.seconds["compute"], 1e-9), "compute_seconds": timer.seconds["compute"]}

    return run_stage(ctx, "logprob", compute, inputs={"rollouts": rollouts}, weights_version=weights_version)
