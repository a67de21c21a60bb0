"""The stages of one on-policy distillation step (``nrl distill``; its recipe: :mod:`flows.algorithms.distill`)::

    prompts ──► generate ──► rollouts ─┬─► score ──► rewards                 (the student samples; rewards are logged)
                                       ├─► teacher_topk ──► teacher ─┐       (the teacher's top-k logits)
                                       └─────────────────────────────┴─► distill_train ──► train

``prompts``, ``generate`` and ``score`` are GRPO's stages (reading the ``distillation`` section's
sampling keys). ``teacher_topk`` runs the teacher (a Ray-hosted ``Policy`` without optimizer)
over the student's sequences and commits ``topk_logits [B, S, k]`` (float32) and ``topk_indices
[B, S, k]`` (int64) as the step's ``teacher`` dataset, so a resume never calls the teacher again
for a committed step. ``distill_train`` trains the student with
:class:`~nrl_tasks.algorithms.distillation.DistillationLossFn` on the response tokens
(``token_mask``) of the rollouts against those top k; it records the weights checksum, which a
replay from the persisted ``rollouts`` and ``teacher`` checks (:func:`distill_update`, the one
update both run).

A teacher actor that dies inside ``teacher_topk`` is made again (fresh, the teacher's weights
are its model folder's) and the call is tried once more; a second fault fails the stage.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from prefect import task
from ray.exceptions import RayActorError

from nrl_tasks.algorithms.distillation import DistillationLossFn
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.graph import GRPO_GRAPH, StageGraph, StageSpec
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, run_stage
from nrl_tasks.stages.train import finite_or_none, timed_update, train_metrics

__all__ = ["DISTILL_GRAPH", "DISTILL_TRAIN_KEYS", "distill_batch", "distill_train", "distill_update", "teacher_topk"]

_log = logging.getLogger(__name__)

#: a distillation step's stages (its metrics line: ``prompts_s`` ... ``teacher_s``, ``train_s``)
DISTILL_GRAPH = StageGraph((
    *(GRPO_GRAPH.spec(name) for name in ("prompts", "generate", "score")),
    StageSpec("teacher_topk", "teacher", ("rollouts",), ("teacher",), label="teacher"),
    StageSpec("distill_train", "train", ("rollouts", "teacher"), ("policy",), retried=True, label="train"),
))
#: the ``train`` figures a step keeps
DISTILL_TRAIN_KEYS = ("loss", "grad_norm", "kl_forward", "kl_reverse", "teacher_topk_mass")


def distill_batch(rollouts: BatchedDataDict, teacher: BatchedDataDict | None = None) -> BatchedDataDict:
    """The student's training rows of a step: the rollouts' ``input_ids``, ``input_lengths``,
    ``token_mask`` (the response tokens), ``sample_mask`` (all ones) and, given the step's
    ``teacher`` dataset, ``teacher_topk_logits`` / ``teacher_topk_indices``."""
    rows = BatchedDataDict({
        "input_ids": rollouts["input_ids"], "input_lengths": rollouts["input_lengths"],
        "token_mask": rollouts["token_mask"].to(torch.float32),
        "sample_mask": torch.ones(rollouts["input_ids"].shape[0], dtype=torch.float32),
    })
    if teacher is not None:
        if teacher["topk_indices"].shape[:2] != rollouts["input_ids"].shape:
            raise ValueError(f"the teacher's top k {tuple(teacher['topk_indices'].shape)} does not cover the rollouts "
                             f"{tuple(rollouts['input_ids'].shape)}")
        rows["teacher_topk_logits"] = teacher["topk_logits"].to(torch.float32)
        rows["teacher_topk_indices"] = teacher["topk_indices"].to(torch.int64)
    return rows


def distill_update(run: RunContext, batches: Any) -> dict[str, float]:
    """One distillation update of ``run``'s student from a step's ``rollouts`` and ``teacher``
    batches: what :func:`distill_train` computes and a replay repeats. Scalar metrics."""
    cfg = run.cfg
    loss_fn = DistillationLossFn(cfg.loss_fn)
    result = run.policy.train(distill_batch(batches["rollouts"], batches["teacher"]), loss_fn,
                              gbs=cfg.policy.train_global_batch_size, mbs=cfg.policy.train_micro_batch_size)
    return train_metrics(result, loss_fn.metric_reductions)


@task(name="teacher_topk", task_run_name="teacher_topk-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def teacher_topk(ctx: StepContext, rollouts: DatasetRef) -> DatasetRef:
    """The teacher's top-k logits (``distillation.topk_logits_k``) of the student's sequences of
    the step; persist them as ``teacher``."""
    k = ctx.cfg.distillation.topk_logits_k

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        rows = distill_batch(inputs["rollouts"])
        actors = ctx.run.actors
        with timer.phase("compute"):
            try:
                ctx.actor_call("teacher_topk", "teacher", actors.teacher.worker_group.workers)
                out = actors.teacher.get_topk_logits(rows, k)
            except RayActorError as exc:
                _log.warning("teacher_topk of step %d: the teacher actor died (%s); making it again", ctx.step, exc)
                actors.start_teacher(fresh=True)
                out = actors.teacher.get_topk_logits(rows, k)
        tokens = int(rows["input_lengths"].sum())
        return BatchedDataDict({"topk_logits": out["topk_logits"].to(torch.float32),
                                "topk_indices": out["topk_indices"].to(torch.int64)}), {
            "k": k, "compute_seconds": timer.seconds["compute"],
            "tokens_per_s": tokens / max(timer.seconds["compute"], 1e-9)}

    return run_stage(ctx, "teacher_topk", compute, inputs={"rollouts": rollouts})


@task(name="distill_train", task_run_name="distill_train-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def distill_train(ctx: StepContext, rollouts: DatasetRef, teacher: DatasetRef) -> DatasetRef:
    """One update of the student on the step's rollouts against the teacher's top k (version
    ``step - 1`` before, ``step`` after); persist its metrics and the weights checksum as ``train``."""

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        metrics, row = timed_update(ctx, "distill_train", distill_update, inputs, timer)
        tokens = int(inputs["rollouts"]["input_lengths"].sum())
        row["step"] = torch.tensor([ctx.step], dtype=torch.int64)
        return BatchedDataDict(row), finite_or_none({
            **{k: metrics.get(k) for k in DISTILL_TRAIN_KEYS},
            "train_seconds": timer.seconds["train"], "tokens_per_s": tokens / max(timer.seconds["train"], 1e-9),
            "weights_checksum": ctx.policy.weights_checksum(),
        }, f"distill_train of step {ctx.step}")

    return run_stage(ctx, "distill_train", compute, inputs={"rollouts": rollouts, "teacher": teacher},
                     output="train", weights_version=ctx.step)
