"""``train`` stage: one GRPO policy update from the persisted rollouts, logprobs and advantages.

The train input is assembled only from committed datasets, so the same step can be *replayed*
bit-identically after a restore from checkpoint (:func:`replay_train`; training is
deterministic). The output dataset (``steps/step_N/train``) is one row of scalar metrics;
its manifest marks the step trained and records ``weights_version`` (= N after the update)
and, when enabled, the policy's ``weights_checksum`` after the update, which replays verify.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from prefect import task

import storage
from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.graph import REPLAY_INPUTS
from nrl_tasks.stages.logprob import check_policy_version, logprob_needed
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, run_stage
from nrl_tasks.utils.refit import checksum_algorithm

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.algorithms.loss_functions import ClippedPGLossConfig
    from nrl_tasks.models.policy.interfaces import PolicyInterface

__all__ = ["build_train_data", "finite_or_none", "grpo_update", "replay_train", "run_train", "timed_update", "train",
           "train_metrics"]

_log = logging.getLogger(__name__)


def finite_or_none(figures: dict[str, Any], where: str) -> dict[str, Any]:
    """``figures`` with every non-finite float replaced by None (JSON has no NaN/inf; the
    manifest would refuse it after the work is done), each replacement logged as a warning."""
    out = {}
    for key, value in figures.items():
        if isinstance(value, float) and not math.isfinite(value):
            _log.warning("%s: metric %r is %r, recorded as null", where, key, value)
            value = None
        out[key] = value
    return out

#: The datasets ``train`` reads (from the stage graph).
TRAIN_INPUT_STAGES = REPLAY_INPUTS


def build_train_data(rollouts: BatchedDataDict, logprobs: BatchedDataDict | None, adv: BatchedDataDict) -> BatchedDataDict:
    """The ``ClippedPGLossFn`` input: ``input_ids, input_lengths, token_mask, sample_mask,
    advantages [B,S], prev_logprobs, generation_logprobs, reference_policy_logprobs`` (the two
    policy logprob columns only with ``logprobs``: a skipped ``logprob`` stage has none)."""
    token_mask = rollouts["token_mask"].to(torch.float32)
    lp = {} if logprobs is None else {
        "prev_logprobs": logprobs["prev_logprobs"].to(torch.float32),
        "reference_policy_logprobs": logprobs["reference_policy_logprobs"].to(torch.float32),
    }
    return BatchedDataDict(
        {
            "input_ids": rollouts["input_ids"],
            "input_lengths": rollouts["input_lengths"],
            "token_mask": token_mask,
            "sample_mask": adv["sample_mask"].to(torch.float32),
            # one advantage per sample [B] (GRPO), or per token [B, S] (REINFORCE++ with the KL in the reward)
            "advantages": (a if (a := adv["advantages"].to(torch.float32)).ndim == 2 else a.unsqueeze(1)) * token_mask,
            **lp,
            "generation_logprobs": rollouts["generation_logprobs"].to(torch.float32),
            # the sample's reward (VAPO's positive-example NLL); advantages datasets carry it since issue 12
            **({"rewards": adv["rewards"].to(torch.float32)} if "rewards" in adv else {}),
        }
    )


def _scalar(v: Any) -> float | None:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean()) if v.numel() else None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


def train_metrics(result: dict[str, Any], reductions: Mapping[str, str] | None = None) -> dict[str, float]:
    """Scalar metrics of a ``Policy.train`` result. The loss function's per-micro-batch figures
    (``all_mb_metrics``, of every rank) are normalised by the global batch's token or sequence
    count, so they are summed over a global batch and averaged over global batches (NeMo-RL's
    reduction); ``reductions`` (the loss function's ``metric_reductions``) names the figures
    combined otherwise (``min``, ``max``, ``mean``); ``*_min`` / ``*_max`` take the extremum."""
    out: dict[str, float] = {}
    for k, v in result.items():
        s = _scalar(v)
        if s is not None:
            out[k] = s
    n_gb = max(1, int(out.get("num_global_batches", 1)))
    mb = result.get("all_mb_metrics")
    per_key: dict[str, list[float]] = {}
    if isinstance(mb, dict):
        for k, vals in mb.items():
            per_key[k] = [x for x in map(_scalar, vals if isinstance(vals, list) else [vals]) if x is not None]
    elif isinstance(mb, list):
        for d in mb:
            for k, v in (d.items() if isinstance(d, dict) else ()):
                if (x := _scalar(v)) is not None:
                    per_key.setdefault(k, []).append(x)
    how = dict(reductions or {})
    for k, vals in per_key.items():
        if not vals or k in out:
            continue
        r = how.get(k) or ("max" if k.endswith("_max") else "min" if k.endswith("_min") else "sum")
        out[k] = {"max": max, "min": min, "mean": lambda v: sum(v) / len(v)}.get(r, lambda v: sum(v) / n_gb)(vals)
    return out


def run_train(policy: PolicyInterface, data: BatchedDataDict, loss_cfg: ClippedPGLossConfig, *, gbs: int, mbs: int) -> dict[str, float]:
    """One ``Policy.train`` call with ``ClippedPGLossFn(loss_cfg)``; scalar metrics."""

    loss_fn = ClippedPGLossFn(loss_cfg)
    result = policy.train(data, loss_fn, gbs=gbs, mbs=mbs)
    return train_metrics(result, loss_fn.metric_reductions)


def _check_version(policy: PolicyInterface, step: int) -> None:
    """``Policy.train`` bumps the version once per (non-eval) call: after step N it must be N."""
    if policy.weights_version != step:
        raise RuntimeError(f"after train of step {step} the policy reports weights version {policy.weights_version}")


def grpo_update(run: Any, batches: Mapping[str, BatchedDataDict]) -> dict[str, float]:
    """One GRPO update of ``run``'s policy from a step's ``rollouts``, ``logprobs`` (only when the
    loss or advantages read them) and ``advantages`` batches: what :func:`train` computes and a
    replay repeats. Scalar metrics."""
    cfg = run.cfg
    logprobs = batches.get("logprobs") if logprob_needed(cfg) else None
    data = build_train_data(batches["rollouts"], logprobs, batches["advantages"])
    return run_train(run.policy, data, cfg.loss_fn, gbs=cfg.policy.train_global_batch_size, mbs=cfg.policy.train_micro_batch_size)


def replay_train(
    run: Any, step: int, inputs: tuple[str, ...] = REPLAY_INPUTS,
    update: Callable[[Any, Mapping[str, BatchedDataDict]], Any] = grpo_update,
) -> dict[str, Any]:
    """Re-run the committed ``train`` of ``step`` from its persisted inputs (after a restore;
    ``run``: the :class:`~nrl_tasks.stages.context.RunContext`): the committed datasets of
    ``inputs`` (the algorithm's ``train`` inputs) handed to ``update`` (its one update).

    Verifies the recorded weights checksum when there is one; raises ``RuntimeError`` if the
    replay does not reproduce it (training not deterministic) or the inputs are missing.
    """

    layout, kw = run.layout, run.storage_kw
    meta = storage.read_manifest(layout.stage_uri(step, "train"), **kw).meta
    batches = {d: storage.load_batch(layout.stage_uri(step, d), **kw) for d in inputs
               if storage.is_committed(layout.stage_uri(step, d), **kw)}
    update(run, batches)
    _check_version(run.policy, step)
    expected = meta.get("weights_checksum")
    if expected:
        got = run.policy.weights_checksum(algorithm=checksum_algorithm(expected))
        if got != expected:
            raise RuntimeError(
                f"replay of train step {step} gave weights checksum {got}, the run recorded {expected}: "
                "training is not deterministic (or the persisted inputs changed)"
            )
    return {"step": step, "replayed": True}


def timed_update(
    ctx: StepContext, stage: str, update: Callable[[Any, Mapping[str, BatchedDataDict]], dict[str, float]],
    inputs: Mapping[str, BatchedDataDict], timer: Any,
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The part of every algorithm's train stage that calls the policy: the policy must hold
    version ``step - 1`` (``StalePolicyError``), ``update(run, inputs)`` runs timed as ``train``,
    and the policy must hold ``step`` after it. Returns the update's metrics and its finite ones
    as the one-row batch the stage commits."""
    policy = ctx.policy
    check_policy_version(policy, ctx.step - 1, f"{stage} of step {ctx.step}")
    ctx.actor_call(stage, "policy", policy.worker_group.workers)
    with timer.phase("train"):
        metrics = update(ctx.run, inputs)
    _check_version(policy, ctx.step)
    return metrics, {k: torch.tensor([v], dtype=torch.float64) for k, v in metrics.items() if math.isfinite(v)}


@task(name="train", task_run_name="train-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def train(ctx: StepContext, rollouts: DatasetRef, logprobs: DatasetRef | None, advantages: DatasetRef) -> DatasetRef:
    """One policy update on the step's batch; persist its metrics as ``train`` (marks the step trained).

    Expects the policy at weights version ``step - 1`` (``StalePolicyError`` otherwise) and leaves
    it at ``step``. The manifest records ``weights_checksum`` after the update (replays verify it).
    A non-finite loss, grad_norm, lr or parameter raises ``NonFiniteTrainingError`` (through
    Ray: a ``RayTaskError`` that is also an instance of it) and commits nothing.
    """
    cfg = ctx.cfg

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        metrics, row = timed_update(ctx, "train", grpo_update, inputs, timer)
        checksum = ctx.policy.weights_checksum() if cfg.logger.weights_checksum else None
        tokens = int(inputs["rollouts"]["input_lengths"].sum())
        row["step"] = torch.tensor([ctx.step], dtype=torch.int64)
        # the worker's finite-value guard raises NonFiniteTrainingError for a non-finite loss or
        # grad_norm (nothing is committed then); a non-finite figure left is recorded as null
        return BatchedDataDict(row), finite_or_none({
            "train_seconds": timer.seconds["train"], "tokens_per_s": tokens / max(timer.seconds["train"], 1e-9),
            "weights_checksum": checksum, "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm"),
            # importance-sampling weights pi_prev / pi_gen of the step's tokens (async GRPO: one version apart)
            "is_weight_mean": metrics.get("sampling_importance_ratio"),
            "is_weight_max": metrics.get("sampling_importance_ratio_max"),
            # parameters + gradients + optimizer state on policy rank 0 (sharded by FSDP2)
            "policy_state_mb_per_rank": metrics.get("policy_state_mb_per_rank"),
        }, f"train of step {ctx.step}")

    inputs = {"rollouts": rollouts, "advantages": advantages, **({"logprobs": logprobs} if logprobs is not None else {})}
    return run_stage(ctx, "train", compute, inputs=inputs, weights_version=ctx.step)
