"""The stages of one reward-model training step (``nrl rm``; its recipe: :mod:`flows.algorithms.rm`)::

    pairs = preference_pairs(ctx)          # the step's pairs, tokenised (DPO's stage)   -> pairs
    trained = rm_train(ctx, pairs)         # one optimizer step (BradleyTerryLossFn)     -> train
    rm_validate(ctx)                       # when due: held-out pairs                    -> val

Each is a Prefect task around :func:`~nrl_tasks.stages.runner.run_stage` (skip if committed,
load the references it is handed, compute, commit). The draw of step ``k`` is the ``k``-th block of
``policy.train_global_batch_size`` pairs of the run's pair order (``rm.seed``). ``train`` records
the weights checksum after the update, which a resume's replay from the persisted ``pairs`` checks
(:func:`rm_update`, the one update both run). Validation (``rm.val_period``, ``rm.val_at_end``):
the held-out pairs' loss, accuracy and margin in eval mode (:mod:`nrl_tasks.stages.supervised`).
"""

from __future__ import annotations

import math
from typing import Any

from prefect import task

from nrl_tasks.algorithms.reward_model import BradleyTerryLossFn
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.graph import StageGraph, StageSpec
from nrl_tasks.stages.preferences import build_pair_batch
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, run_stage
from nrl_tasks.stages.supervised import supervised_validation
from nrl_tasks.stages.train import timed_update, train_metrics

__all__ = ["RM_GRAPH", "RM_TRAIN_KEYS", "rm_train", "rm_update", "rm_validate"]

#: a reward-model step's stages (its metrics line: ``pairs_s``, ``train_s``)
RM_GRAPH = StageGraph((
    StageSpec("preference_pairs", "pairs", label="pairs"),
    StageSpec("rm_train", "train", ("pairs",), ("policy",), retried=True, label="train"),
))
#: the ``train`` figures a step keeps
RM_TRAIN_KEYS = ("loss", "grad_norm", "accuracy", "rewards_margin_mean", "rewards_chosen_mean", "rewards_rejected_mean")


def _pair_rows(pairs: Any) -> BatchedDataDict:
    return BatchedDataDict({k: pairs[k] for k in ("input_ids", "input_lengths", "token_mask", "sample_mask")})


def rm_update(run: RunContext, batches: Any) -> dict[str, float]:
    """One Bradley-Terry update of ``run``'s reward model from a step's ``pairs``: what
    :func:`rm_train` computes and a replay repeats (the batch sizes count pairs, each pair is two
    rows). Scalar metrics."""
    cfg, loss_fn = run.cfg, BradleyTerryLossFn()
    result = run.policy.train(_pair_rows(batches["pairs"]), loss_fn, gbs=2 * cfg.policy.train_global_batch_size,
                              mbs=2 * cfg.policy.train_micro_batch_size)
    return train_metrics(result, loss_fn.metric_reductions)


@task(name="rm_train", task_run_name="rm_train-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def rm_train(ctx: StepContext, pairs: DatasetRef) -> DatasetRef:
    """One update of the reward model on the step's pairs (version ``step - 1`` before, ``step``
    after); persist its metrics and the weights checksum as ``train``."""

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        metrics, row = timed_update(ctx, "rm_train", rm_update, inputs, timer)
        return BatchedDataDict(row), {
            **{k: metrics[k] for k in RM_TRAIN_KEYS if k in metrics and math.isfinite(metrics[k])},
            "train_seconds": timer.seconds["train"], "weights_checksum": ctx.policy.weights_checksum(),
        }

    return run_stage(ctx, "rm_train", compute, inputs={"pairs": pairs}, output="train", weights_version=ctx.step)


@task(name="validate", task_run_name="validate-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def rm_validate(ctx: StepContext) -> DatasetRef:
    """The held-out pairs' Bradley-Terry loss, accuracy and margin on the reward model after step
    ``ctx.step`` (``val``)."""
    cfg = ctx.cfg
    recs = ctx.run.records("preferences_val")

    def build(n: int) -> BatchedDataDict:
        return _pair_rows(build_pair_batch(recs, list(range(n)), ctx.tokenizer, cfg.data, cfg.policy.max_total_sequence_length))

    return supervised_validation(ctx, build, BradleyTerryLossFn(), rows=len(recs), rows_per_item=2, val_cfg=cfg.rm)
