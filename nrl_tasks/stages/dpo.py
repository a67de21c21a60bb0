"""The stages of one DPO step (``nrl dpo``; its recipe: :mod:`flows.algorithms.dpo`)::

    pairs = preference_pairs(ctx)                  # the step's pairs, tokenised        -> pairs
    reference = reference_logprobs(ctx, pairs)     # the frozen reference's logprobs    -> reference
    trained = dpo_train(ctx, pairs, reference)     # one optimizer step (DPOLossFn)     -> train
    dpo_validate(ctx)                              # when due: held-out pairs           -> val

Each is a Prefect task around :func:`~nrl_tasks.stages.runner.run_stage` (skip if committed,
load the references it is handed, compute, commit), so a step re-run after a crash recomputes only
what is not committed, and Prefect draws the edges. The draw of step ``k`` is the ``k``-th block of
``policy.train_global_batch_size`` pairs of the run's pair order (``dpo.seed``; reshuffled every
epoch with ``data.shuffle``). ``train`` records the weights checksum after the update, which
:func:`replay_train` checks when a resume replays the step from its persisted batches
(:func:`dpo_update`, the one update both run). Validation (``dpo.val_period``): the held-out pairs'
loss, accuracy and margin in eval mode (:mod:`nrl_tasks.stages.supervised`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from prefect import task

from nrl_tasks.algorithms.dpo import DPOLossFn
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.data import batch_draw
from nrl_tasks.stages.graph import StageGraph, StageSpec
from nrl_tasks.stages.preferences import build_pair_batch, pairs_seed
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, run_stage
from nrl_tasks.stages.supervised import supervised_validation
from nrl_tasks.stages.train import timed_update, train_metrics

__all__ = ["DPO_DATASETS", "DPO_GRAPH", "dpo_train", "dpo_update", "dpo_validate", "preference_pairs", "reference_logprobs"]

#: a DPO step's stages (its metrics line keeps the names ``pairs_s``, ``reference_s``, ``train_s``)
DPO_GRAPH = StageGraph((
    StageSpec("preference_pairs", "pairs", label="pairs"),
    StageSpec("reference_logprobs", "reference", ("pairs",), ("policy",), retried=True, label="reference"),
    StageSpec("dpo_train", "train", ("pairs", "reference"), ("policy",), retried=True, label="train"),
))
#: a DPO step's datasets, in order (``train`` marks the step trained)
DPO_DATASETS = DPO_GRAPH.datasets


@task(name="preference_pairs", task_run_name="preference_pairs-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def preference_pairs(ctx: StepContext) -> DatasetRef:
    """Draw and tokenise the step's pairs from the run's frozen pairs; persist ``pairs`` (DPO's and
    reward-model training's first stage)."""
    cfg = ctx.cfg

    def compute(_: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        recs, idx = batch_draw(ctx, "preferences", pairs_seed(cfg))
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


def dpo_update(run: RunContext, batches: Any) -> dict[str, float]:
    """One DPO update of ``run``'s policy from a step's ``pairs`` and ``reference`` batches: what
    :func:`dpo_train` computes and a replay repeats (NeMo-RL's convention: the batch sizes count
    pairs, each pair is two rows). Scalar metrics."""
    cfg, pairs = run.cfg, batches["pairs"]
    data = BatchedDataDict({k: pairs[k] for k in ("input_ids", "input_lengths", "token_mask", "sample_mask")})
    data["reference_policy_logprobs"] = batches["reference"]["reference_policy_logprobs"]
    loss_fn = DPOLossFn(cfg.dpo)
    result = run.policy.train(data, loss_fn, gbs=2 * cfg.policy.train_global_batch_size,
                              mbs=2 * cfg.policy.train_micro_batch_size)
    return train_metrics(result, loss_fn.metric_reductions)


@task(name="dpo_train", task_run_name="dpo_train-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def dpo_train(ctx: StepContext, pairs: DatasetRef, reference: DatasetRef) -> DatasetRef:
    """One DPO update on the step's pairs (policy at version ``step - 1`` before, ``step`` after);
    persist its metrics and the weights checksum as ``train``."""

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        metrics, row = timed_update(ctx, "dpo_train", dpo_update, inputs, timer)
        keep = ("loss", "grad_norm", "accuracy", "rewards_margin_mean", "rewards_chosen_mean", "rewards_rejected_mean",
                "preference_loss", "sft_loss")
        return BatchedDataDict(row), {
            **{k: metrics[k] for k in keep if k in metrics and math.isfinite(metrics[k])},
            "train_seconds": timer.seconds["train"], "weights_checksum": ctx.policy.weights_checksum(),
        }

    return run_stage(ctx, "dpo_train", compute, inputs={"pairs": pairs, "reference": reference}, output="train",
                     weights_version=ctx.step)


@task(name="validate", task_run_name="validate-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def dpo_validate(ctx: StepContext) -> DatasetRef:
    """The held-out pairs' DPO loss, accuracy and margin on the policy after step ``ctx.step``
    (``val``; the reference's logprobs computed with them: the held-out pairs are not persisted
    per step)."""
    cfg = ctx.cfg
    recs = ctx.run.records("preferences_val")

    def build(n: int) -> BatchedDataDict:
        b = build_pair_batch(recs, list(range(n)), ctx.tokenizer, cfg.data, cfg.policy.max_total_sequence_length)
        data = BatchedDataDict({k: b[k] for k in ("input_ids", "input_lengths", "token_mask", "sample_mask")})
        ref = ctx.policy.get_reference_policy_logprobs(BatchedDataDict({"input_ids": b["input_ids"], "input_lengths": b["input_lengths"]}))
        data["reference_policy_logprobs"] = ref["reference_logprobs"].to(torch.float32)
        return data

    return supervised_validation(ctx, build, DPOLossFn(cfg.dpo), rows=len(recs), rows_per_item=2, val_cfg=cfg.dpo)
