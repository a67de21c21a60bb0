"""Async GRPO in the run's flow: the phases of :class:`nrl_tasks.stages.schedule.StepSchedule`,
with the generation lane (``prompts`` -> ``generate`` -> ``score`` of later steps) submitted as
concurrent Prefect tasks while the policy lane (``logprob`` -> ``advantages`` -> ``train``,
``checkpoint`` when due) runs in the flow's thread, and the refit of version ``k`` between
``train(k)`` and ``train(k+1)`` when both lanes are free::

    rollouts_2 = generate.submit(ctx2, prompts_2, v0)       # generation workers
    trained_1  = train(ctx1, rollouts_1, logprobs_1, adv_1)  # policy workers, at the same time
    refit(ctx1, trained_1, 1)                                # both free: v1 to the generation workers

Every generation runs on its scheduled version exactly (``generate`` refuses another), so the
rollouts of a step do not depend on timing. The Prefect run graph shows the overlap: the task
runs of two steps run at the same time, with their data edges.

State of this prototype (branch ``async``, issue 11): fresh runs and resumes of runs whose
trained prefix has every scheduled rollout committed; a resume that would need an older weights
version than the restored one to regenerate missing rollouts is refused with a clear error. Actor
faults fail the run (no in-run recovery yet); validation is not scheduled in async mode.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from prefect import get_run_logger
from prefect.utilities.annotations import quote

from flows.step import StepPlan, StepRefs, publish_step
from nrl_tasks.stages.advantages import advantages
from nrl_tasks.stages.checkpoint import checkpoint
from nrl_tasks.stages.context import RunContext
from nrl_tasks.stages.generate import generate, prompts
from nrl_tasks.stages.logprob import logprob
from nrl_tasks.stages.refit import refit
from nrl_tasks.stages.schedule import Event, StepSchedule
from nrl_tasks.stages.score import score
from nrl_tasks.stages.train import train

__all__ = ["run_async_steps"]


def _generation_lane(run: RunContext, events: list[Event], after: Any) -> dict[int, tuple[Any, Any, Any]]:
    """Submit the phase's generations in step order on the generation workers (each waits for the
    one before: one set of workers); ``{step: (prompts, rollouts future, rewards future)}``."""
    out: dict[int, tuple[Any, Any]] = {}
    prev = after
    for e in events:
        c = quote(run.step(e.step))
        p = prompts(c)  # cheap, in the flow thread: the prompts of a step are fixed by its seed
        r = generate.submit(c, p, e.version, wait_for=[prev] if prev is not None else None)
        s = score.submit(c, r)
        out[e.step] = (p, r, s)
        prev = s
    return out


def run_async_steps(
    run: RunContext,
    plan_for: Callable[[int], StepPlan],
    *,
    first_step: int,
    fence: Callable[[], None] | None = None,
    publish: Callable[..., Any] = publish_step,
    after_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Run steps ``first_step..max`` on the async schedule; the wall seconds of each trained step.
    ``publish(ctx, refs, plan, wall_seconds=, extra=)``: the step's metrics line and artifacts
    (the flow's, as in sync mode); ``after_step(step)``: retention."""
    log = get_run_logger()
    sched = StepSchedule.from_config(run.cfg)
    log.info("async GRPO schedule (age %d):\n%s", sched.lookahead, sched.timeline())
    lanes: dict[int, tuple[Any, Any, Any]] = {}
    last_gen = None
    walls: list[float] = []
    for phase in sched.phases():
        gens = [e for e in phase if e.kind == "generate"]
        trains = [e for e in phase if e.kind == "train"]
        refits = [e for e in phase if e.kind == "refit"]
        if gens:
            lanes.update(_generation_lane(run, gens, last_gen))
            last_gen = lanes[gens[-1].step][2]
        for e in trains:
            if e.step < first_step:
                continue
            if fence is not None:
                fence()
            t0 = time.perf_counter()
            ctx = run.step(e.step)
            c = quote(ctx)
            prompt_ref, r_future, s_future = lanes.pop(e.step)
            rollouts, rewards = r_future.result(), s_future.result()
            plan = plan_for(e.step)
            logprobs = logprob(c, rollouts, e.step - 1)
            advs = advantages(c, rollouts, rewards)
            trained = train(c, rollouts, logprobs, advs)
            ck = checkpoint(c, trained, plan.config_hash) if plan.checkpoint else None
            refs = StepRefs(
                step=e.step,
                datasets={"prompts": prompt_ref, "rollouts": rollouts, "rewards": rewards, "logprobs": logprobs, "advantages": advs, "train": trained},
                refit=None, checkpoint=ck, val=None, flow_run_id=None,
            )
            publish(ctx, refs, plan, wall_seconds=time.perf_counter() - t0, extra={"trajectory_age": sched.trajectory_age(e.step)})
            if after_step is not None:
                after_step(e.step)
            walls.append(time.perf_counter() - t0)
        if refits:
            for _, _, s in list(lanes.values()):  # every generation on an older version is done first
                s.result()
            for e in refits:
                refit(quote(run.step(e.step)), None, e.version)
    return walls
