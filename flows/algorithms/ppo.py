"""``nrl ppo``: PPO with a value model and GAE, as a Prefect flow.

A config with a ``ppo`` section (:mod:`nrl_tasks.config.ppo`) is a PPO run: the policy samples as
in GRPO, a value model (the ``value`` section, default the policy's model, with a one-output
head; its own Ray worker group) gives per-token values, GAE turns the rewards and values into
per-token advantages and returns, and each step trains the value model (clipped squared error,
``value_loss_fn``) and the policy (GRPO's clipped policy gradient, ``loss_fn``) for
``ppo.ppo_epochs`` passes. Each step (:mod:`nrl_tasks.stages.ppo`)::

    prompts, rollouts, rewards = generation lane on weights v = step - 1        (GRPO's stages)
    logprobs = logprob(rollouts); values = values(rollouts)                      (policy; value model)
    advantages = gae(rollouts, rewards, values[, logprobs])                      (advantages, returns, values)
    train = ppo_train(rollouts, logprobs, advantages)                            (value model, then policy)
    checkpoint when due (both models) || refit the policy to version step; validate when due

Checkpoints hold both models (``value/`` beside the policy's ``weights/`` and ``optimizer/``); the
refit moves the policy's weights only. Validation is GRPO's (held-out greedy accuracy).

**Resume**: as GRPO's: committed stages are skipped; after a restore of both models the ``train``
stages after the checkpoint are replayed from the persisted ``rollouts``, ``logprobs`` and
``advantages`` (:func:`~nrl_tasks.stages.ppo.ppo_update`), each checked against the policy's
recorded weights checksum. The run is synchronous (``ppo.async_ppo`` is refused).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect.futures import PrefectFuture
from prefect.utilities.annotations import quote

import storage
from flows.algorithms.epochs import epoch_problems, epoch_steps
from flows.algorithms.grpo import GRPORecipe, train_prompt_count
from flows.algorithms.lanes import beside, generation_lane
from flows.algorithms.training import recipe_flow
from flows.config import MasterConfig
from flows.observe.metrics import build_step_metrics, mark_rebuilt, stored_step
from flows.run.recipe import Actors
from nrl_tasks.run_layout import RunLayout
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.logprob import logprob
from nrl_tasks.stages.ppo import PPO_GRAPH, PPO_TRAIN_KEYS, ppo_gae, ppo_train, ppo_update, values
from nrl_tasks.stages.refs import StepRefs
from nrl_tasks.stages.schedule import StepSchedule

__all__ = ["PPO", "PPORecipe", "ppo"]


class PPORecipe(GRPORecipe):
    """PPO with a value model as a recipe (see the module docstring): GRPO's sampling, scoring and
    logprobs; the value model's values, GAE and the two models' updates instead of GRPO's."""

    kind = "ppo"
    section = "ppo"
    graph = PPO_GRAPH
    actors = Actors(generation=True, reward_model=True, environment=True, value=True)
    unread_sections = ("dpo", "sft", "rm", "distillation", "teacher")

    def budget(self, cfg: MasterConfig) -> int:
        p = cfg.ppo
        return epoch_steps(p.max_num_steps, p.max_num_epochs, lambda: train_prompt_count(cfg), p.num_prompts_per_step)

    def validation_due(self, cfg: MasterConfig, step: int) -> bool:
        p = cfg.ppo
        if step == 0:
            return bool(p.val_at_start and p.val_period)
        return bool(p.val_period and step % p.val_period == 0) or (p.val_at_end and step == self.budget(cfg))

    def stop_rule(self, cfg: MasterConfig) -> None:
        return None

    def schedule(self, cfg: MasterConfig) -> StepSchedule:
        return StepSchedule(self.budget(cfg))

    def facts_options(self, cfg: MasterConfig) -> dict[str, Any]:
        return {"max_steps": self.budget(cfg), "step_inputs": self.graph.step_inputs}

    def check_recompute(self, specs: Sequence[tuple[str, int]], cfg: MasterConfig) -> None:
        return None

    def check_config(self, cfg: MasterConfig) -> list[str]:
        p = cfg.ppo
        return epoch_problems("ppo", p.max_num_epochs, lambda: train_prompt_count(cfg), p.num_prompts_per_step,
                              "ppo.num_prompts_per_step", "prompts")

    def inputs(self, ctx: StepContext, version: int, *, overlap: bool = False) -> dict[str, Any]:
        return generation_lane(ctx, version, overlap_score=overlap)

    def submit_inputs(self, ctx: StepContext, version: int, after: Any = None) -> dict[str, Any]:
        raise NotImplementedError("PPO runs synchronously")  # the schedule has age 0: never called

    def update(self, ctx: StepContext, inputs: Mapping[str, Any]) -> dict[str, Any]:
        data = _before_train(ctx, inputs)
        return {**data, "train": ppo_train(quote(ctx), data["rollouts"], data["logprobs"], data["advantages"])}

    def recompute(self, run: RunContext, step: int, generation_version: int) -> None:
        ctx = run.step(step)
        _before_train(ctx, generation_lane(ctx, generation_version))

    def train_once(self, run: RunContext, batches: Mapping[str, Any]) -> dict[str, float]:
        return ppo_update(run, batches)

    def metrics_line(self, ctx: StepContext, refs: StepRefs, wall_seconds: float | None) -> dict[str, Any]:
        rw = storage.load_batch(ctx.uri("rewards"), columns=["rewards", "reward_valid"], **ctx.storage_kw)
        manifests = {k: v.summary() for k, v in refs.datasets.items() if v is not None}
        row = build_step_metrics(
            ctx.step, manifests, refit=refs.refit.summary() if refs.refit else None,
            val=refs.val.summary() if refs.val else None, checkpoint=refs.checkpoint.summary() if refs.checkpoint else None,
            wall_seconds=wall_seconds, rewards=(rw["rewards"], rw["reward_valid"]), graph=PPO_GRAPH,
        )
        return _with_ppo_figures(row, manifests)

    def rebuild_line(self, layout: RunLayout, step: int, storage_options: dict[str, Any] | None) -> dict[str, Any]:
        manifests, val, checkpoint = stored_step(layout, step, PPO_GRAPH.datasets, storage_options)
        return mark_rebuilt(_with_ppo_figures(
            build_step_metrics(step, manifests, val=val, checkpoint=checkpoint, graph=PPO_GRAPH), manifests))

    def run(self, **params: Any) -> dict[str, Any]:
        return ppo(**params)


def _before_train(ctx: StepContext, gen: Mapping[str, Any]) -> dict[str, Any]:
    """The step's datasets before ``ppo_train``: ``logprobs`` and ``values`` (the policy and the value
    model, side by side while a submitted ``score`` runs), then ``advantages`` (GAE)."""
    c = quote(ctx)
    rollouts = gen["rollouts"]
    vals = values.submit(c, rollouts)
    lp, rewards = beside(gen["rewards"], lambda: logprob(c, rollouts, ctx.step - 1))
    vals_ref = vals.result() if isinstance(vals, PrefectFuture) else vals
    kl_reward = ctx.cfg.loss_fn.use_kl_in_reward and ctx.cfg.loss_fn.reference_policy_kl_penalty > 0
    adv = ppo_gae(c, rollouts, rewards, vals_ref, lp if kl_reward else None)
    return {**gen, "rewards": rewards, "logprobs": lp, "values": vals_ref, "advantages": adv}


def _with_ppo_figures(row: dict[str, Any], manifests: Mapping[str, Any]) -> dict[str, Any]:
    """A metrics line without GRPO's group figure, plus the value model's and GAE's figures."""
    row.pop("groups_with_signal", None)
    train = manifests.get("train") or {}
    row.update({k: train.get(k) for k in PPO_TRAIN_KEYS if k not in ("loss", "grad_norm")})
    row["policy_warmup"] = bool(train.get("policy_warmup"))
    row["advantage_abs_mean"] = (manifests.get("advantages") or {}).get("advantage_abs_mean")
    return row


#: PPO's recipe
PPO = PPORecipe()

#: the Prefect flow of PPO runs (a deployment's entrypoint: ``flows/algorithms/ppo.py:ppo``)
ppo = recipe_flow(PPO, summary="Train with PPO: a value model, GAE and the clipped policy gradient (see the module "
                  "docstring).")
