"""The two lanes of a GRPO step, each defined once; every driver calls them.

::

    generation lane   prompts -> generate -> score            on the generation workers, weights version v
                      (grpo.use_dynamic_sampling: generation batches until enough groups have
                       reward variance, then the step's prompts, rollouts and rewards: sampled_stages)
    policy lane       logprob -> advantages -> train -> checkpoint when due    on the policy workers

Between and after them the step driver (:mod:`flows.algorithms.driver`) refits the generation
workers and validates when due. Who calls them:

- synchronous GRPO, one Prefect subflow per step (:func:`flows.algorithms.step.grpo_step`, the
  driver's unit at age 0): the generation lane inline on version ``step - 1``, then the policy
  lane, refit, validate;
- async GRPO (the driver at age > 0): the generation lane of later steps submitted as concurrent
  tasks (:class:`GenerationLane`) while the policy lane runs in the flow's thread;
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
from nrl_tasks.stages.checkpoint import checkpoint
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.dynamic_sampling import dynamic_sampling, sampled_refs
from nrl_tasks.stages.generate import generate, prompts
from nrl_tasks.stages.logprob import logprob, logprob_needed
from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.schedule import Event
from nrl_tasks.stages.score import score
from nrl_tasks.stages.train import train

__all__ = ["GenerationLane", "beside", "data_stages", "generation_lane", "policy_inputs", "policy_lane", "sampled_stages"]

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


class GenerationLane:
    """The generation lane of later steps submitted to the generation workers as concurrent
    Prefect tasks, in step order (each waits for the one before: one set of workers), for the
    driver's async schedule. ``{step: (prompts, rollouts future, rewards future)}``.

    Async GRPO refuses dynamic sampling (``nrl_tasks.config.combinations``: a step's extra
    generation batches would not be fixed by the schedule), so submitted steps generate one batch."""

    def __init__(self, run: RunContext) -> None:
        self.run = run
        self.pending: dict[int, tuple[Any, Any, Any]] = {}
        self.futures: list[Any] = []

    def submit(self, events: list[Event]) -> None:
        prev = self.futures[-1] if self.futures else None
        for e in events:
            c = quote(self.run.step(e.step))
            p = prompts(c)  # cheap, in the flow thread: the prompts of a step are fixed by its seed
            r = generate.submit(c, p, e.version, wait_for=[prev] if prev is not None else None)
            s = score.submit(c, r)
            self.pending[e.step] = (p, r, s)
            self.futures += [r, s]
            prev = s

    def take(self, step: int, version: int) -> dict[str, Any]:
        """The step's prompts, rollouts and rewards (the generation lane inline when not
        submitted: a step trained before the resume, whose datasets are committed and skip)."""
        if step in self.pending:
            p, r, s = self.pending.pop(step)
            return {"prompts": p, "rollouts": r.result(), "rewards": s.result()}
        return generation_lane(self.run.step(step), version)

    def settle(self) -> None:
        """Wait until every submitted generation has finished (failed or not)."""
        for f in self.futures:
            f.wait()

    def first_error(self) -> BaseException | None:
        """The exception of the first failed submitted task (the later ones did not run)."""
        for f in self.futures:
            if f.state.is_failed():
                err = f.state.result(raise_on_failure=False)
                if isinstance(err, BaseException):
                    return err
        return None


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


def policy_lane(ctx: StepContext, gen: dict[str, Any], plan: Any, *, submit_checkpoint: bool = False) -> tuple[dict[str, Any], Any]:
    """``logprob`` -> ``advantages`` -> ``train`` of step ``ctx.step`` (the policy holds version
    ``step - 1``), then ``checkpoint`` when ``plan.checkpoint``: the step's datasets (``train``
    included) and the checkpoint's reference (``None`` when not due; with ``submit_checkpoint``
    its future, so that the caller refits while it is written: both only read the trained weights)."""
    data = policy_inputs(ctx, gen, ctx.step - 1)
    trained = train(quote(ctx), data["rollouts"], data["logprobs"], data["advantages"])
    if not plan.checkpoint:
        ck = None
    elif submit_checkpoint:
        ck = checkpoint.submit(quote(ctx), trained, plan.config_hash)
    else:
        ck = checkpoint(quote(ctx), trained, plan.config_hash)
    return {**data, "train": trained}, ck


def data_stages(ctx: StepContext, weights_version: int, *, generation_version: int | None = None) -> dict[str, Any]:
    """The step's datasets before ``train`` (stages that find their output committed skip):
    the generation lane on ``generation_version`` (default ``weights_version``), then
    ``logprob`` (on ``weights_version``) and ``advantages``. Recovery recomputes a replayed
    step's missing datasets with it."""
    version = weights_version if generation_version is None else generation_version
    return policy_inputs(ctx, generation_lane(ctx, version), weights_version)
