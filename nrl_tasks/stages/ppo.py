"""The stages of one PPO step with a value model (``nrl ppo``; its recipe: :mod:`flows.algorithms.ppo`)::

    prompts ──► generate ──► rollouts ─┬─► score ──► rewards ──────────────────┐
                                       ├─► logprob ──► logprobs ─────────────────┼─► gae ──► advantages ─┐
                                       ├─► values ──► values ────────────────────┘                       │
                                       └──────────────────────────── rollouts, logprobs ─────────────────┴─► ppo_train ──► train

``prompts``, ``generate``, ``score`` and ``logprob`` are GRPO's stages (reading the ``ppo``
section's sampling keys). ``values`` runs the value model over the step's sequences (``values
[B, S]``: the value of the state before each token). ``gae`` computes per-token advantages and
returns (:mod:`nrl_tasks.algorithms.gae`; with ``loss_fn.use_kl_in_reward`` the reference KL of
each token goes into its reward) and keeps the step's values beside them (the value loss clips
around them). ``ppo_train`` makes ``ppo.ppo_epochs`` passes over the batch with the value model
(:class:`~nrl_tasks.algorithms.value_loss.ValueLossFn`) and, after the critic warm-up
(``ppo.policy_training_start_step``), as many with the policy (GRPO's ``ClippedPGLossFn`` on the
per-token advantages). The two models are independent within a step (the advantages are fixed),
so NeMo-RL's interleaved order (value, policy, value, policy, ...) and this one (the value
model's passes in one call, then the policy's) make the same updates. Each model takes one
weights version a step; during warm-up the policy is only moved to the step's version. The
``train`` commit records both models' checksums; a replay from the persisted ``rollouts``,
``logprobs`` and ``advantages`` (:func:`ppo_update`) reproduces both.

A value actor that dies inside ``values`` or ``ppo_train`` takes the policy workers down with it:
the run's recovery then re-creates both, restores both from the last checkpoint and replays the
steps after it (a value model alone cannot be put back to the step's weights).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from prefect import task
from ray.exceptions import RayActorError

from nrl_tasks.algorithms.gae import gae, terminal_rewards, whiten
from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
from nrl_tasks.algorithms.utils import calculate_kl
from nrl_tasks.algorithms.value_loss import ValueLossFn
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.graph import GRPO_GRAPH, StageGraph, StageSpec
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, run_stage
from nrl_tasks.stages.train import build_train_data, finite_or_none, timed_update, train_metrics

__all__ = ["PPO_GRAPH", "PPO_TRAIN_KEYS", "gae_advantages", "ppo_gae", "ppo_train", "ppo_update", "repeat_rows", "values"]

_log = logging.getLogger(__name__)
T = TypeVar("T")

#: a PPO step's stages (its metrics line: ``values_s``, ``gae_s``, ``train_s`` besides GRPO's)
PPO_GRAPH = StageGraph((
    *(GRPO_GRAPH.spec(name) for name in ("prompts", "generate", "score", "logprob")),
    StageSpec("values", "values", ("rollouts",), ("value",), retried=True),
    StageSpec("gae", "advantages", ("rollouts", "rewards", "values"), optional_inputs=("logprobs",)),
    StageSpec("ppo_train", "train", ("rollouts", "logprobs", "advantages"), ("policy", "value"), retried=True,
              label="train"),
))
#: the ``train`` figures a step keeps (``value_*``: the value model's)
PPO_TRAIN_KEYS = ("loss", "grad_norm", "value_loss", "value_grad_norm", "vf_clipfrac", "values_mean", "returns_mean")


def _rows(rollouts: BatchedDataDict) -> BatchedDataDict:
    return BatchedDataDict({"input_ids": rollouts["input_ids"], "input_lengths": rollouts["input_lengths"]})


def _value_call(run: RunContext, what: str, call: Callable[[], T]) -> T:
    """``call()`` on the value model; when its actor died, the policy workers are killed too (see the
    module docstring) and the fault is raised for the run's recovery."""
    try:
        return call()
    except RayActorError:
        _log.warning("%s: the value model's actor died; taking the policy workers down with it so that the run's "
                     "recovery restores both models together", what)
        try:
            run.policy.worker_group.shutdown(force=True)
        except Exception as exc:  # noqa: BLE001 - already gone
            _log.debug("policy shutdown: %s", exc)
        raise


def gae_advantages(
    rollouts: BatchedDataDict, rewards: BatchedDataDict, values_batch: BatchedDataDict, cfg: Any,
    logprobs: BatchedDataDict | None = None,
) -> BatchedDataDict:
    """``advantages [B, S]``, ``returns [B, S]``, ``values [B, S]`` and ``sample_mask [B]`` of a step
    (``cfg``: the run config; see the module docstring)."""
    est, loss = cfg.ppo.adv_estimator, cfg.loss_fn
    valid = rewards["reward_valid"].to(torch.bool)
    mask = rollouts["token_mask"].to(torch.float32) * valid.to(torch.float32).unsqueeze(1)
    per_token = None
    if loss.use_kl_in_reward and loss.reference_policy_kl_penalty > 0:
        if logprobs is None:
            raise ValueError("loss_fn.use_kl_in_reward needs the step's logprobs (prev and reference)")
        per_token = -loss.reference_policy_kl_penalty * calculate_kl(
            logprobs["prev_logprobs"].double(), logprobs["reference_policy_logprobs"].double(), loss.reference_policy_kl_type
        ).float()
    r = terminal_rewards(torch.where(valid, rewards["rewards"].to(torch.float32), 0.0), mask, per_token)
    v = values_batch["values"].to(torch.float32)
    lam_value = est.gae_lambda_value if est.gae_lambda_value is not None else est.gae_lambda
    if est.length_adaptive_alpha > 0:
        lam_policy: Any = (1.0 - 1.0 / (est.length_adaptive_alpha * mask.sum(1)).clamp(min=1.0)).clamp(0.0, 1.0)
    else:
        lam_policy = est.gae_lambda_policy if est.gae_lambda_policy is not None else est.gae_lambda
    adv, returns = gae(r, v, mask, est.gae_gamma, lam_policy)
    if not isinstance(lam_policy, float) or lam_policy != lam_value:  # VAPO: the returns' own lambda
        _, returns = gae(r, v, mask, est.gae_gamma, lam_value)
    if est.normalize_advantages:
        adv = whiten(adv, mask)
    return BatchedDataDict({"advantages": adv, "returns": returns, "values": v * mask, "sample_mask": valid.to(torch.float32)})


@task(name="values", task_run_name="values-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def values(ctx: StepContext, rollouts: DatasetRef) -> DatasetRef:
    """The value model's values of the step's sequences (it holds version ``step - 1``); persist ``values``."""

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        model = ctx.run.actors.value
        if model.weights_version != ctx.step - 1:
            from nrl_tasks.stages.errors import StalePolicyError

            raise StalePolicyError(f"values of step {ctx.step} need the value model at version {ctx.step - 1}, it holds "
                                   f"{model.weights_version}")
        ctx.actor_call("values", "value", model.worker_group.workers)
        with timer.phase("compute"):
            out = _value_call(ctx.run, f"values of step {ctx.step}", lambda: model.get_values(_rows(inputs["rollouts"])))
        return BatchedDataDict({"values": out["values"].to(torch.float32)}), {"compute_seconds": timer.seconds["compute"]}

    return run_stage(ctx, "values", compute, inputs={"rollouts": rollouts}, weights_version=ctx.step - 1)


@task(name="gae", task_run_name="gae-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def ppo_gae(ctx: StepContext, rollouts: DatasetRef, rewards: DatasetRef, values_ref: DatasetRef,
            logprobs: DatasetRef | None = None) -> DatasetRef:
    """GAE advantages and returns of the step; persist them as ``advantages``."""

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        out = gae_advantages(inputs["rollouts"], inputs["rewards"], inputs["values"], ctx.cfg, inputs.get("logprobs"))
        mask = inputs["rollouts"]["token_mask"].to(torch.float32) * out["sample_mask"].unsqueeze(1)
        n = float(mask.sum()) or 1.0
        return out, finite_or_none({"advantage_abs_mean": float((out["advantages"].abs() * mask).sum()) / n,
                                    "returns_mean": float((out["returns"] * mask).sum()) / n}, f"gae of step {ctx.step}")

    inputs = {"rollouts": rollouts, "rewards": rewards, "values": values_ref,
              **({"logprobs": logprobs} if logprobs is not None else {})}
    return run_stage(ctx, "gae", compute, inputs=inputs)


def repeat_rows(data: BatchedDataDict, times: int) -> BatchedDataDict:
    """``data``'s rows ``times`` over, in order: ``times`` passes of global batches in one train call."""
    return BatchedDataDict.from_batches([data] * times) if times > 1 else data


def ppo_update(run: RunContext, batches: Any) -> dict[str, float]:
    """One PPO step's updates from its ``rollouts``, ``logprobs`` and ``advantages``: the value model's
    ``ppo_epochs`` passes, then the policy's (or, during the critic warm-up, the policy moved to the
    step's version untrained). What :func:`ppo_train` computes and a replay repeats. Scalar metrics."""
    cfg, step = run.cfg, run.policy.weights_version + 1
    rollouts, adv = batches["rollouts"], batches["advantages"]
    epochs, gbs, mbs = cfg.ppo.ppo_epochs, cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size
    value_rows = BatchedDataDict({
        "input_ids": rollouts["input_ids"], "input_lengths": rollouts["input_lengths"],
        "token_mask": rollouts["token_mask"].to(torch.float32), "sample_mask": adv["sample_mask"].to(torch.float32),
        "returns": adv["returns"].to(torch.float32), "values": adv["values"].to(torch.float32),
    })
    value_fn = ValueLossFn(cfg.value_loss_fn)
    value_model = run.actors.value
    vres = _value_call(run, f"ppo_train of step {step}", lambda: value_model.train(repeat_rows(value_rows, epochs), value_fn,
                                                                                  gbs=gbs, mbs=mbs))
    vm = train_metrics(vres, value_fn.metric_reductions)
    out = {"value_loss": vm.get("loss"), "value_grad_norm": vm.get("grad_norm"),
           **{k: vm[k] for k in ("vf_clipfrac", "values_mean", "returns_mean") if k in vm}}
    if step > cfg.ppo.policy_training_start_step:
        loss_fn = ClippedPGLossFn(cfg.loss_fn)
        data = build_train_data(rollouts, batches.get("logprobs"), adv)
        out.update(train_metrics(run.policy.train(repeat_rows(data, epochs), loss_fn, gbs=gbs, mbs=mbs),
                                 loss_fn.metric_reductions))
    else:  # critic warm-up: the policy keeps its weights and takes the step's version
        run.policy.set_weights_version(step)
        out["policy_warmup"] = 1.0
    return {k: float(v) for k, v in out.items() if v is not None}


@task(name="ppo_train", task_run_name="ppo_train-{ctx.run_id}-step{ctx.step}", **TASK_DEFAULTS)
def ppo_train(ctx: StepContext, rollouts: DatasetRef, logprobs: DatasetRef | None, advantages: DatasetRef) -> DatasetRef:
    """The step's value and policy updates (both at ``step - 1`` before, ``step`` after); persist their
    metrics and both weights checksums as ``train``."""

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        metrics, row = timed_update(ctx, "ppo_train", ppo_update, inputs, timer)
        tokens = int(inputs["rollouts"]["input_lengths"].sum())
        row["step"] = torch.tensor([ctx.step], dtype=torch.int64)
        return BatchedDataDict(row), finite_or_none({
            **{k: metrics.get(k) for k in PPO_TRAIN_KEYS}, "policy_warmup": bool(metrics.get("policy_warmup")),
            "train_seconds": timer.seconds["train"], "tokens_per_s": tokens / max(timer.seconds["train"], 1e-9),
            "weights_checksum": ctx.policy.weights_checksum(),
            "value_weights_checksum": _value_call(ctx.run, "ppo_train", ctx.run.actors.value.weights_checksum),
        }, f"ppo_train of step {ctx.step}")

    inputs = {"rollouts": rollouts, "advantages": advantages, **({"logprobs": logprobs} if logprobs is not None else {})}
    return run_stage(ctx, "ppo_train", compute, inputs=inputs, output="train", weights_version=ctx.step)
