"""Async GRPO in the run's flow: the phases of :class:`nrl_tasks.stages.schedule.StepSchedule`,
with the generation lane (``prompts`` -> ``generate`` -> ``score`` of later steps) submitted as
concurrent Prefect tasks while the policy lane (``logprob`` -> ``advantages`` -> ``train``,
``checkpoint`` when due) runs in the flow's thread (both lanes are :mod:`flows.algorithms.lanes`, the ones a
synchronous step runs), and the refit of version ``k`` between
``train(k)`` and ``train(k+1)`` when both lanes are free::

    rollouts_2 = generate.submit(ctx2, prompts_2, 0)         # generation workers, version 0
    trained_1  = train(ctx1, rollouts_1, logprobs_1, adv_1)  # policy workers, at the same time
    refit(ctx1, trained_1, 1)                                # both free: v1 to the generation workers

Every generation runs on its scheduled version exactly (``generate`` refuses another), so the
rollouts of a step do not depend on timing. The Prefect run graph shows the overlap: the task
runs of two steps run at the same time, with their data edges.

**Faults and resumes.** When a stage of either lane fails on an actor fault, the loop lets every
submitted generation finish, recovers (:func:`flows.run.recovery.recover_after`: the resume plan knows
the schedule, so a step whose rollouts are missing is generated on its own version: the policy is
restored to a checkpoint at or before it and replayed through it) and runs the schedule again from
the run's trained prefix; committed stages skip. A resumed run starts the same way. The retries
are the sync loop's (``grpo.stage_retries``, ``grpo.refit.retries`` per step and stage).

**Validation** (``grpo.val_period``): after ``train(k)`` the generation workers are refitted to
``k`` (the scheduled refit, or an extra one once the generations on older versions are done, for
the last steps of the run, whose versions no generation needs) and ``validate`` runs on them.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from prefect import get_run_logger
from prefect.utilities.annotations import quote

from flows.algorithms.lanes import GenerationLane, policy_lane
from flows.algorithms.step import StepPlan, StepRefs, publish_step
from nrl_tasks.stages.context import RunContext
from nrl_tasks.stages.evaluate import validate
from nrl_tasks.stages.refit import refit
from nrl_tasks.stages.schedule import Event, StepSchedule

__all__ = ["run_async_steps"]


def run_async_steps(
    run: RunContext,
    plan_for: Callable[[int], StepPlan],
    *,
    trained: int,
    budget: Any,
    fence: Callable[[], None] | None = None,
    publish: Callable[..., Any] = publish_step,
    after_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Run the steps after the trained prefix ``trained`` on the async schedule (step ``trained``
    once more: its committed stages skip, what it had not finished is done), through actor
    faults (see the module docstring); the wall seconds of each step. ``budget``: the run's
    :class:`flows.run.recovery.RetryBudget`; ``publish(ctx, refs, plan, wall_seconds=, extra=)``: the
    step's metrics line and artifacts (the flow's, as in sync mode); ``after_step(step)``: retention."""
    from flows.run.recovery import recover_after

    log = get_run_logger()
    sched = StepSchedule.from_config(run.cfg)
    log.info("async GRPO schedule (age %d):\n%s", sched.lookahead, sched.timeline())
    walls: list[float] = []
    finished: set[int] = set()
    start, held = max(1, trained), trained  # the generation workers hold the trained prefix
    while True:
        lane = GenerationLane(run)
        try:
            _run_schedule(run, sched, lane, plan_for, start, held, finished, walls, fence, publish, after_step)
            return walls
        except BaseException as exc:
            lane.settle()  # recovery refits the generation workers: nothing may be generating
            err = lane.first_error() if _unfinished(exc) else None
            step = run.last_failure[0] if run.last_failure else start
            last = recover_after(run, err or exc, budget, step=step, max_step=sched.max_steps, log=log)
            start, held = max(1, last), last


def _unfinished(exc: BaseException) -> bool:
    """A future whose upstream failed (``wait_for``) raises ``UnfinishedRun``: the cause is upstream."""
    from prefect.exceptions import UnfinishedRun

    return isinstance(exc, UnfinishedRun)


def _run_schedule(
    run: RunContext,
    sched: StepSchedule,
    lane: GenerationLane,
    plan_for: Callable[[int], StepPlan],
    start: int,
    held: int,
    finished: set[int],
    walls: list[float],
    fence: Callable[[], None] | None,
    publish: Callable[..., Any],
    after_step: Callable[[int], None] | None,
) -> None:
    """The schedule's phases from train ``start`` on, the generation workers holding ``held``
    (the trained prefix: steps before ``start`` are trained, their generations done)."""
    trained: dict[int, Any] = {}
    for phase in sched.phases():
        gens = [e for e in phase if e.kind == "generate" and e.step >= start]
        if gens:
            lane.submit(gens)
        val_due = []
        for e in (e for e in phase if e.kind == "train" and e.step >= start and e.step not in finished):
            if fence is not None:
                fence()
            t0 = time.perf_counter()
            ctx = run.step(e.step)
            gen = lane.take(e.step, sched.generation_version(e.step))
            plan = plan_for(e.step)
            datasets, ck = policy_lane(ctx, gen, plan)
            trained[e.step] = datasets["train"]
            if plan.validate:
                val_due.append((e.step, ctx, datasets, ck, plan, t0))
                continue
            _finish(ctx, StepRefs(e.step, datasets, checkpoint=ck), plan, t0, sched, publish, after_step, finished, walls)
        refits = [e for e in phase if e.kind == "refit" and e.version > held]
        if val_due and not refits:  # the last steps: no generation needs their version
            refits = [Event("refit", s, s) for s, *_ in val_due]
        if refits:
            lane.settle()  # every generation on an older version is done first
            err = lane.first_error()
            if err is not None:  # a generation failed: recover before refitting its workers
                raise err
            for e in refits:
                result = refit(quote(run.step(e.step)), trained.get(e.step), e.version)
                held = e.version
                for s, ctx, datasets, ck, plan, t0 in (v for v in val_due if v[0] == e.version):
                    val = validate(quote(ctx), result, s)
                    refs = StepRefs(s, datasets, refit=result, checkpoint=ck, val=val)
                    _finish(ctx, refs, plan, t0, sched, publish, after_step, finished, walls)


def _finish(ctx: Any, refs: StepRefs, plan: StepPlan, t0: float, sched: StepSchedule, publish: Callable[..., Any],
            after_step: Callable[[int], None] | None, finished: set[int], walls: list[float]) -> None:
    """The step's metrics line, artifacts and retention, once."""
    wall = time.perf_counter() - t0
    publish(ctx, refs, plan, wall_seconds=wall, extra={"trajectory_age": sched.trajectory_age(refs.step)})
    if after_step is not None:
        after_step(refs.step)
    finished.add(refs.step)
    walls.append(wall)
