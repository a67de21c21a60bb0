"""``score`` stage: one reward per rollout.

Sources, by config: the built-in exact-match reward of the arithmetic task, a user function
``env.reward_fn: "package.module:function"`` called on ``(prompts, responses, answers)``, or a
reward model (a sequence-classification ``Policy``) through ``Policy.score``. Rewards that are
NaN/inf, beyond float32 range, not numbers, or come from a raising function are masked
(``reward_valid`` False) and counted in the manifest (``invalid_rewards``) instead of ending
the run.

With ``grpo.reward_scaling.enabled`` the valid rewards are clamped and mapped linearly (NeMo-RL's
key), before the shaping below.

Output columns: ``rewards [B]`` float32, ``reward_valid [B]`` bool. With
``grpo.reward_shaping.enabled`` (DAPO's soft overlong punishment,
:mod:`nrl_tasks.algorithms.reward_shaping`) ``rewards`` holds the shaped reward and
``task_rewards [B]`` the environment's. On a generation batch of dynamic sampling the manifest
also counts ``groups_with_signal`` (groups whose rewards differ).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

import torch
from prefect import get_run_logger, task
from prefect.exceptions import MissingContextError

import storage
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.environments.rewards import DEFAULT_REWARD_FN, load_reward_fn, safe_rewards
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, run_stage

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.config.data import EnvConfig
    from nrl_tasks.models.policy.interfaces import PolicyInterface

__all__ = ["NoValidRewardError", "check_some_reward_valid", "compute_rewards", "scale_rewards", "environment_rewards", "reward_function", "score"]

_log = logging.getLogger(__name__)


def _logger() -> Any:
    """Prefect's run logger inside a task or flow run, this module's logger elsewhere."""
    try:
        return get_run_logger()
    except MissingContextError:
        return _log


def reward_function(env_cfg: EnvConfig):
    """The configured verifiable reward callable (default: arithmetic exact match)."""

    return load_reward_fn(env_cfg.reward_fn or DEFAULT_REWARD_FN)


def compute_rewards(
    rollouts: BatchedDataDict,
    env_cfg: EnvConfig,
    reward_model: PolicyInterface | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``(rewards [B] float32, valid [B] bool, errors)`` for a rollout batch."""

    if env_cfg.reward_model.enabled:
        if reward_model is None:
            raise RuntimeError("env.reward_model.enabled but no reward-model Policy is running")
        data = BatchedDataDict({"input_ids": rollouts["input_ids"], "input_lengths": rollouts["input_lengths"]})
        out = reward_model.score(data)
        scores = out["scores"] if "scores" in out else out["score"]
        rewards = scores.reshape(-1).to(torch.float32)
        valid = torch.isfinite(rewards)
        errors = [] if bool(valid.all()) else [f"{int((~valid).sum())} reward-model scores not finite"]
        return torch.where(valid, rewards, torch.zeros_like(rewards)), valid, errors
    fn = reward_function(env_cfg)
    prompts: Sequence[str] = rollouts["prompt"]
    return safe_rewards(fn, list(prompts), list(rollouts["response"]), list(rollouts["answer"]))


def environment_rewards(ctx: StepContext, rollouts: BatchedDataDict) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """A multi-turn step's ``(rewards, valid)`` (``env_rewards``, persisted by ``generate``) and
    the environment's ``global_post_process_and_metrics`` figures (``env_<name>``, numbers only)."""
    rewards = rollouts["env_rewards"].to(torch.float32)
    valid = torch.isfinite(rewards)
    _, metrics = ctx.run.actors.environment.post_process(rollouts)
    figures = {f"env_{k}": float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return torch.where(valid, rewards, torch.zeros_like(rewards)), valid, figures


def scale_rewards(rewards: torch.Tensor, cfg: Any) -> torch.Tensor:
    """``grpo.reward_scaling``: clamp to ``[source_min, source_max]``, map onto ``[target_min, target_max]``.

    >>> from nrl_tasks.config.grpo import RewardScalingConfig
    >>> scale_rewards(torch.tensor([-1.0, 0.0, 0.5, 2.0]), RewardScalingConfig(enabled=True, target_min=-1.0)).tolist()
    [-1.0, -1.0, 0.0, 1.0]
    """
    r = rewards.to(torch.float64).clamp(cfg.source_min, cfg.source_max)
    return (cfg.target_min + (r - cfg.source_min) / (cfg.source_max - cfg.source_min) * (cfg.target_max - cfg.target_min)).to(rewards.dtype)


class NoValidRewardError(ValueError):
    """Too many consecutive steps without one valid reward: the run learns nothing (not an actor
    fault; fix the reward source, then resume)."""


def check_some_reward_valid(ctx: StepContext, n: int, errors: Sequence[str]) -> None:
    """A step none of whose ``n`` rewards is valid: logged as an error; a
    :class:`NoValidRewardError` when the ``grpo.max_steps_without_valid_reward`` steps before it
    had none either (their ``rewards`` manifests; a step whose manifest is gone counts as valid)."""
    tolerated = ctx.cfg.grpo.max_steps_without_valid_reward
    source = ctx.cfg.env.environment or ("env.reward_model" if ctx.cfg.env.reward_model.enabled else ctx.cfg.env.reward_fn)
    source = source or "the built-in exact-match reward"
    _logger().error("step %d: none of its %d rewards is valid (%s): the step is masked and teaches nothing; %s",
                    ctx.step, n, source, "; ".join(errors)[:500] or "NaN or inf rewards")
    earlier = list(range(ctx.step - tolerated, ctx.step))
    if earlier and earlier[0] < 1:
        return
    for step in earlier:
        try:
            meta = storage.read_manifest(ctx.at(step).uri("rewards"), **ctx.storage_kw).meta
        except FileNotFoundError:
            return
        if meta.get("reward_mean") is not None:
            return
    raise NoValidRewardError(
        f"steps {ctx.step - tolerated}-{ctx.step}: no valid reward in {tolerated + 1} consecutive steps from {source} "
        f"(NaN, inf or raised; grpo.max_steps_without_valid_reward={tolerated}): the run learns nothing. "
        f"Fix the reward source, then resume the run"
    )


@task(name="score", task_run_name="score-{ctx.run_id}-{ctx.label}", **TASK_DEFAULTS)
def score(ctx: StepContext, rollouts: DatasetRef) -> DatasetRef:
    """Score the step's rollouts; persist ``rewards``."""

    def compute(inputs: Any, timer: Any) -> tuple[BatchedDataDict, dict[str, Any]]:
        env_figures: dict[str, float] = {}
        if ctx.cfg.env.environment is not None:  # the episodes' rewards, summed over turns when they were generated
            rewards, valid, env_figures = environment_rewards(ctx, inputs["rollouts"])
            errors: list[str] = []
        else:
            rewards, valid, errors = compute_rewards(inputs["rollouts"], ctx.cfg.env, ctx.run.reward_model)
        if errors:
            logger = _logger()
            for e in errors:
                logger.warning("step %d reward: %s", ctx.step, e)
        scaling = ctx.cfg.reward_keys.reward_scaling
        if scaling.enabled:  # NeMo-RL's order: scaled first, then shaped, then advantages
            rewards = torch.where(valid, scale_rewards(rewards, scaling), rewards)
        n_valid = int(valid.sum())
        if n_valid == 0 and ctx.gen_batch is None:
            check_some_reward_valid(ctx, int(valid.numel()), errors)
        out, shaped = {"rewards": rewards, "reward_valid": valid}, {}
        shaping = ctx.cfg.reward_keys.reward_shaping
        if shaping.enabled:
            from nrl_tasks.algorithms.reward_shaping import overlong_penalty

            lmax = shaping.max_response_length or ctx.cfg.gen.max_new_tokens
            pen = overlong_penalty(inputs["rollouts"]["generation_lengths"], lmax, shaping.overlong_buffer_length,
                                   shaping.overlong_buffer_penalty)
            out = {"rewards": torch.where(valid, rewards + pen, rewards), "reward_valid": valid, "task_rewards": rewards}
            shaped = {"overlong_penalty_mean": float(pen.double().mean()), "overlong_frac": float((pen < 0).double().mean())}
        if ctx.gen_batch is not None:  # dynamic sampling: the flow samples more while too few groups qualify
            from nrl_tasks.algorithms.dynamic_sampling import groups_with_signal

            shaped["groups_with_signal"] = len(groups_with_signal(out["rewards"], valid, inputs["rollouts"]["group_id"]))
        return BatchedDataDict(out), {**shaped, **env_figures,
            # float64: a mean of float32 rewards near float32's max must not overflow to inf
            "reward_mean": float(rewards[valid].double().mean()) if n_valid else None,  # JSON has no NaN: None = no valid reward
            "invalid_rewards": int(valid.numel() - n_valid), "reward_errors": "; ".join(errors)[:2000],
        }

    return run_stage(ctx, "score", compute, inputs={"rollouts": rollouts})
