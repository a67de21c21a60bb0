"""The two lanes of a GRPO step, each defined once; every driver calls them through GRPO's recipe.

::

    generation lane   prompts -> generate -> score            on the generation workers, weights version v
                      (grpo.use_dynamic_sampling: generation batches until enough groups have
                       reward variance, then the step's prompts, rollouts and rewards: sampled_stages)
    policy lane       logprob -> advantages -> train          on the policy workers

They are GRPO's ``inputs`` and ``update`` (:mod:`flows.algorithms.grpo`); after them every
algorithm's step ends the same way (:func:`flows.algorithms.step.finish_step`: checkpoint beside
the refit, validation). Who calls them:

- a step at age 0 (:func:`flows.algorithms.step.run_step_body`): the generation lane inline on
  version ``step - 1``, ``score`` submitted beside ``logprob``, then the policy lane;
- async GRPO (the driver at age > 0): the generation lane of later steps submitted as concurrent
  tasks (:func:`submit_generation`) while the policy lane runs in the flow's thread;
- recovery (:mod:`flows.run.recovery`): a step generated again on its scheduled version, or a replayed
  step's missing datasets recomputed (:func:`data_stages`), before its ``train`` is replayed.

Every stage is a Prefect task handed the :class:`~nrl_tasks.stages.refs.DatasetRef` objects (or
futures) the stages before it returned, so Prefect records the data edges; the step context is
passed quoted (no edge through it). Every stage is idempotent: one that finds its output
committed skips.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from prefect.futures import PrefectFuture
from prefect.utilities.annotations import quote

from nrl_tasks.stages.advantages import advantages, needs_logprobs
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.dynamic_sampling import dynamic_sampling, sampled_refs
from nrl_tasks.stages.generate import generate, prompts
from nrl_tasks.stages.logprob import logprob, logprob_needed
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.score import score
from nrl_tasks.stages.train import train

__all__ = ["beside", "data_stages", "generation_lane", "policy_inputs", "policy_lane", "sampled_stages", "submit_generation"]

T = TypeVar("T")


# ----------------------------------------------------------------------------------------------
# the generation lane


def generation_lane(ctx: StepContext, version: int, *, overlap_score: bool = False) -> dict[str, Any]:
    """The step's ``prompts``, ``rollouts`` and ``rewards``, generated on weights ``version``, in
    the caller's thread (with dynamic sampling: :func:`sampled_stages`). ``overlap_score``: when
    the policy lane computes logprobs, ``score`` is submitted (``rewards`` is then its future) to
    run while ``logprob`` does: both read only the rollouts (:func:`policy_inputs` waits for it)."""
    if ctx.cfg.grpo.use_dynamic_sampling:
        return sampled_stages(ctx, version)
    c = quote(ctx)
    p = prompts(c)
    r = generate(c, p, version)
    rewards = score.submit(c, r) if overlap_score and logprob_needed(ctx.cfg) else score(c, r)
    return {"prompts": p, "rollouts": r, "rewards": rewards}


def sampled_stages(ctx: StepContext, version: int) -> dict[str, DatasetRef]:
    """DAPO's dynamic sampling (:mod:`nrl_tasks.stages.dynamic_sampling`): generation batches
    until ``grpo.num_prompts_per_step`` groups have reward variance (at most
    ``grpo.dynamic_sampling_max_gen_batches``), then the step's prompts, rollouts and rewards."""
    done = sampled_refs(ctx)
    if done is not None:
        return done
    grpo = ctx.cfg.grpo
    batches: list[tuple[DatasetRef, DatasetRef, DatasetRef]] = []
    found = 0
    while found < grpo.num_prompts_per_step and len(batches) < grpo.dynamic_sampling_max_gen_batches:
        g = quote(ctx.gen_batch_ctx(len(batches)))
        p = prompts(g)
        r = generate(g, p, version)
        s = score(g, r)
        batches.append((p, r, s))
        found += int(s.get("groups_with_signal") or 0)
    ps, rs, ss = (list(x) for x in zip(*batches))
    return dynamic_sampling(quote(ctx), ps, rs, ss)


def submit_generation(ctx: StepContext, version: int, after: Any = None) -> dict[str, Any]:
    """The generation lane of a later step submitted (async GRPO's driver,
    :class:`flows.algorithms.driver.InputLane`): ``prompts`` inline (cheap: fixed by the step's
    seed), ``generate`` and ``score`` as futures, ``generate`` after ``after`` (the step before's
    last future: one set of generation workers). Async GRPO refuses dynamic sampling
    (``nrl_tasks.config.combinations``: a step's extra generation batches would not be fixed by
    the schedule), so a submitted step generates one batch."""
    c = quote(ctx)
    p = prompts(c)
    r = generate.submit(c, p, version, wait_for=[after] if after is not None else None)
    return {"prompts": p, "rollouts": r, "rewards": score.submit(c, r)}


# ----------------------------------------------------------------------------------------------
# the policy lane


def policy_inputs(ctx: StepContext, gen: dict[str, Any], weights_version: int) -> dict[str, Any]:
    """The generation lane's datasets plus ``logprobs`` (on the policy at ``weights_version``;
    ``None`` when nothing reads them) and ``advantages``: what ``train`` reads."""
    c = quote(ctx)
    rollouts = gen["rollouts"]
    # a submitted score (overlap_score) runs while logprob does
    logprobs, rewards = beside(gen["rewards"], lambda: logprob(c, rollouts, weights_version) if logprob_needed(ctx.cfg) else None)
    advs = advantages(c, rollouts, rewards, logprobs if needs_logprobs(ctx.cfg) else None)
    return {"prompts": gen["prompts"], "rollouts": rollouts, "rewards": rewards, "logprobs": logprobs,
            "advantages": advs}


def beside(running: Any, work: Callable[[], T]) -> tuple[T, Any]:
    """``work()`` while ``running`` (a submitted task's future, or an already computed value) runs;
    then ``(work's result, running's result)``. The future has ended before this returns, also
    when ``work`` raised; a failed future raises its own error, as the inline call would."""
    try:
        out = work()
    finally:
        if isinstance(running, PrefectFuture):
            running.wait()
    return out, running.result() if isinstance(running, PrefectFuture) else running


def policy_lane(ctx: StepContext, gen: dict[str, Any]) -> dict[str, Any]:
    """``logprob`` -> ``advantages`` -> ``train`` of step ``ctx.step`` (the policy holds version
    ``step - 1``): the step's datasets, ``train`` included. The checkpoint, refit and validation
    that follow are every algorithm's (:func:`flows.algorithms.step.finish_step`)."""
    data = policy_inputs(ctx, gen, ctx.step - 1)
    trained = train(quote(ctx), data["rollouts"], data["logprobs"], data["advantages"])
    return {**data, "train": trained}


def data_stages(ctx: StepContext, weights_version: int, *, generation_version: int | None = None) -> dict[str, Any]:
    """The step's datasets before ``train`` (stages that find their output committed skip):
    the generation lane on ``generation_version`` (default ``weights_version``), then
    ``logprob`` (on ``weights_version``) and ``advantages``. Recovery recomputes a replayed
    step's missing datasets with it."""
    version = weights_version if generation_version is None else generation_version
    return policy_inputs(ctx, generation_lane(ctx, version), weights_version)
