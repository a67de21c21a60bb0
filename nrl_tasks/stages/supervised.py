"""What DPO and SFT share: a validation on held-out rows in the policy's eval mode.

NeMo-RL's validation keys (``val_batches``, ``val_global_batch_size``, ``val_micro_batch_size``,
:class:`~nrl_tasks.config.sft.SupervisedValidation`) pick the held-out rows: the first
``val_batches * val_global_batch_size`` of the run's frozen validation split, evaluated in global
batches of ``val_global_batch_size`` with ``Policy.train(..., eval_mode=True)`` (a forward pass:
no gradient, no optimizer step, the weights version unchanged). The figures are the loss
function's metrics over the rows, prefixed ``val_`` (``val_loss``; DPO adds ``val_accuracy``, the
share of pairs whose chosen response the policy prefers over the reference's margin, and
``val_rewards_margin_mean``), committed as the step's ``val`` dataset, whose manifest the metrics
line reads.

Deviation from NeMo-RL: when the split holds fewer rows than asked for, or a count the batch
sizes do not divide, the largest count they divide is used (NeMo-RL drops the last partial batch
too) and the figures say how many rows were read (``val_rows``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import run_stage
from nrl_tasks.stages.train import train_metrics

__all__ = ["eval_sizes", "supervised_validation"]


def eval_sizes(rows: int, gbs: int, mbs: int, dp: int) -> tuple[int, int, int]:
    """``(rows used, global batch, micro-batch)`` for an evaluation of ``rows`` held-out rows (or
    pairs) asked to run in global batches of ``gbs`` and micro-batches of ``mbs`` on ``dp``
    ranks: the global batch a multiple of ``dp * mbs``, the rows a multiple of the global batch.

    >>> eval_sizes(20, 8, 2, 1), eval_sizes(5, 8, 1, 1), eval_sizes(7, 8, 4, 2)
    ((16, 8, 2), (5, 5, 1), (6, 6, 3))
    """
    mbs = max(1, min(mbs, rows // max(dp, 1)))
    unit = max(dp, 1) * mbs
    if rows < unit:
        raise ValueError(f"validation needs at least {unit} held-out rows (cluster.policy_workers * val_micro_batch_size), "
                         f"the split has {rows}")
    gbs = max(unit, (min(gbs, rows) // unit) * unit)
    return (rows // gbs) * gbs, gbs, mbs


def supervised_validation(
    ctx: StepContext, build: Callable[[int], BatchedDataDict], loss_fn: Any, *, rows: int, rows_per_item: int = 1,
    val_cfg: Any,
) -> DatasetRef:
    """The step's ``val`` dataset (see the module docstring): ``build(n)`` makes the batch of the
    first ``n`` held-out items (``rows_per_item`` rows each: a DPO pair is two), of which the split
    holds ``rows``; ``val_cfg`` holds the validation keys."""
    run = ctx.run

    def compute(_: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        n, gbs, mbs = eval_sizes(min(rows, val_cfg.val_rows), val_cfg.val_global_batch_size, val_cfg.val_micro_batch_size,
                                 run.policy.data_parallel_size)
        data = build(n)
        ctx.actor_call("validate", "policy", run.policy.worker_group.workers)
        with timer.phase("compute"):
            result = run.policy.train(data, loss_fn, eval_mode=True, gbs=gbs * rows_per_item, mbs=mbs * rows_per_item)
        figures = {f"val_{k}": v for k, v in train_metrics(result, getattr(loss_fn, "metric_reductions", None)).items()
                   if k in ("loss", "accuracy", "rewards_margin_mean", "rewards_chosen_mean", "rewards_rejected_mean")
                   and math.isfinite(v)}
        figures["val_rows"] = n
        row = {k: torch.tensor([float(v)], dtype=torch.float64) for k, v in figures.items()}
        return BatchedDataDict(row), {**figures, "compute_seconds": timer.seconds["compute"]}

    return run_stage(ctx, "validate", compute, output="val", weights_version=ctx.step)
