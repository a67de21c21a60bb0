"""The stages of one DPO step (``nrl dpo``; the loop, checkpoints and resume: :mod:`flows.algorithms.dpo`)::

    pairs = preference_pairs(ctx)                  # the step's pairs, tokenised        -> pairs
    reference = reference_logprobs(ctx, pairs)     # the frozen reference's logprobs    -> reference
    trained = dpo_train(ctx, pairs, reference)     # one optimizer step (DPOLossFn)     -> train

Each is a Prefect task around :func:`~nrl_tasks.stages.runner.run_stage` (skip if committed,
load the references it is handed, compute, commit), so a step re-run after a crash recomputes only
what is not committed, and Prefect draws the edges. The draw of step ``k`` is the ``k``-th block of
``policy.train_global_batch_size`` pairs of the run's pair order (``dpo.seed``; reshuffled every
epoch with ``data.shuffle``). ``train`` records the weights checksum after the update, which
:func:`replay_dpo_train` checks when a resume replays the step from its persisted batches.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from prefect import task

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.data import step_record_indices
from nrl_tasks.stages.logprob import check_policy_version
from nrl_tasks.stages.preferences import build_pair_batch
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, run_stage

__all__ = ["DPO_DATASETS", "dpo_train", "preference_pairs", "reference_logprobs", "replay_dpo_train"]

#: a DPO step's datasets, in order (``train`` marks the step trained)
DPO_DATASETS = ("pairs", "reference", "train")


@task(name="preference_pairs", task_run_name="preference_pairs-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def preference_pairs(ctx: StepContext) -> DatasetRef:
    """Draw and tokenise the step's pairs from the run's frozen pairs; persist ``pairs``."""
    cfg = ctx.cfg

    def compute(_: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        recs = ctx.run.records("preferences")
        idx = step_record_indices(num_records=len(recs), step=ctx.step, num_prompts=cfg.policy.train_global_batch_size,
                                  seed=cfg.dpo.seed, shuffle=cfg.data.shuffle)
        return build_pair_batch(recs, idx, ctx.tokenizer, cfg.data, cfg.policy.max_total_sequence_length), {}

    return run_stage(ctx, "preference_pairs", compute, output="pairs")


@task(name="reference_logprobs", task_run_name="reference_logprobs-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def reference_logprobs(ctx: StepContext, pairs: DatasetRef) -> DatasetRef:
    """The reference policy's (initial weights') logprobs of the step's pairs; persist ``reference``."""

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        b = inputs["pairs"]
        ctx.actor_call("reference_logprobs", "policy", ctx.policy.worker_group.workers)
        with timer.phase("compute"):
            data = BatchedDataDict({"input_ids": b["input_ids"], "input_lengths": b["input_lengths"]})
            ref = ctx.policy.get_reference_policy_logprobs(data)["reference_logprobs"].to(torch.float32)
        return BatchedDataDict({"reference_policy_logprobs": ref}), {"compute_seconds": timer.seconds["compute"]}

    return run_stage(ctx, "reference_logprobs", compute, inputs={"pairs": pairs}, output="reference")


def _train_once(run: RunContext, pairs: BatchedDataDict, reference: BatchedDataDict) -> dict[str, float]:
    from nrl_tasks.algorithms.dpo import DPOLossFn
    from nrl_tasks.stages.train import train_metrics

    cfg = run.cfg
    data = BatchedDataDict({k: pairs[k] for k in ("input_ids", "input_lengths", "token_mask", "sample_mask")})
    data["reference_policy_logprobs"] = reference["reference_policy_logprobs"]
    loss_fn = DPOLossFn(cfg.dpo)
    # NeMo-RL's convention: the batch sizes count pairs, each pair is two rows
    result = run.policy.train(data, loss_fn, gbs=2 * cfg.policy.train_global_batch_size,
                              mbs=2 * cfg.policy.train_micro_batch_size)
    return train_metrics(result, loss_fn.metric_reductions)


@task(name="dpo_train", task_run_name="dpo_train-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def dpo_train(ctx: StepContext, pairs: DatasetRef, reference: DatasetRef) -> DatasetRef:
    """One DPO update on the step's pairs (policy at version ``step - 1`` before, ``step`` after);
    persist its metrics and the weights checksum as ``train``."""

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        policy = ctx.policy
        check_policy_version(policy, ctx.step - 1, f"dpo_train of step {ctx.step}")
        ctx.actor_call("dpo_train", "policy", policy.worker_group.workers)
        with timer.phase("train"):
            metrics = _train_once(ctx.run, inputs["pairs"], inputs["reference"])
        if policy.weights_version != ctx.step:
            raise RuntimeError(f"after dpo_train of step {ctx.step} the policy reports version {policy.weights_version}")
        row = {k: torch.tensor([v], dtype=torch.float64) for k, v in metrics.items() if math.isfinite(v)}
        keep = ("loss", "grad_norm", "accuracy", "rewards_margin_mean", "rewards_chosen_mean", "rewards_rejected_mean",
                "preference_loss", "sft_loss")
        return BatchedDataDict(row), {
            **{k: metrics[k] for k in keep if k in metrics and math.isfinite(metrics[k])},
            "train_seconds": timer.seconds["train"], "weights_checksum": policy.weights_checksum(),
        }

    return run_stage(ctx, "dpo_train", compute, inputs={"pairs": pairs, "reference": reference}, output="train",
                     weights_version=ctx.step)


def replay_dpo_train(run: RunContext, step: int) -> None:
    """Re-run the committed ``train`` of ``step`` from its persisted ``pairs`` and ``reference``
    (after a restore); ``RuntimeError`` when the weights checksum differs from the recorded one."""
    import storage

    uri = lambda d: run.layout.stage_uri(step, d)  # noqa: E731
    meta = storage.read_manifest(uri("train"), **run.storage_kw).meta
    _train_once(run, storage.load_batch(uri("pairs"), **run.storage_kw), storage.load_batch(uri("reference"), **run.storage_kw))
    from nrl_tasks.utils.refit import checksum_algorithm

    want = meta.get("weights_checksum")
    got = run.policy.weights_checksum(algorithm=checksum_algorithm(want))
    if run.policy.weights_version != step or (want and got != want):
        raise RuntimeError(
            f"replay of dpo_train step {step} gave weights checksum {got} (version {run.policy.weights_version}), "
            f"the run recorded {want}: training is not deterministic or the persisted batches changed"
        )
