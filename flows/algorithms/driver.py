"""The step driver: one loop that runs a run's :class:`~nrl_tasks.stages.schedule.StepSchedule`,
synchronous GRPO (the schedule with age 0) and async GRPO alike, through actor faults.

Both modes run the same two lanes (:mod:`flows.algorithms.lanes`); what differs is how the
schedule's phases are grouped into units of work:

- **age 0** (``grpo.async_grpo.enabled: false``): every step's phases (``gen k @v(k-1)``,
  ``train k``, ``refit vk``) form one unit (:func:`flows.algorithms.step.grpo_step`'s body: the
  generation lane inline, the policy lane, refit, validation when due), published when done.
  Consecutive steps run grouped in one Prefect subflow (``segment_unit``,
  :func:`flows.algorithms.step.grpo_steps`: ``<run_id>-steps-0001-0010``, steps on a fixed grid
  of ``steps_per_segment``), or each step as its own subflow (``<run_id>-step-0007``), or inline.
  The subflow is what the UI shows and what a fault retries: after a fault in step 3 of
  ``…-steps-0001-0010`` the run goes on with ``…-steps-0003-0010-retry1``.
- **age a > 0** (``grpo.async_grpo``): the phases run in the run's flow, the generation lane of
  later steps submitted as concurrent Prefect tasks (:class:`~flows.algorithms.lanes.GenerationLane`)
  while the policy lane runs in the flow's thread, and the refit of version ``k`` between
  ``train(k)`` and ``train(k+1)`` when both lanes are free::

    rollouts_2 = generate.submit(ctx2, prompts_2, 0)         # generation workers, version 0
    trained_1  = train(ctx1, rollouts_1, logprobs_1, adv_1)  # policy workers, at the same time
    refit(ctx1, trained_1, 1)                                # both free: v1 to the generation workers

  Every generation runs on its scheduled version exactly (``generate`` refuses another), so the
  rollouts of a step do not depend on timing; the Prefect run graph shows the overlap with its
  data edges. **Validation** (``grpo.val_period``): after ``train(k)`` the generation workers are
  refitted to ``k`` (the scheduled refit, or an extra one for the last steps of the run, whose
  versions no generation needs) and ``validate`` runs on them.

**Faults and resumes**, the same in both modes: when a stage fails on an actor fault, the driver
lets every submitted generation finish, recovers (:func:`flows.run.recovery.recover_after`: the
resume plan knows the schedule, so a step whose rollouts are missing is generated on its own
version) and runs the schedule again from the run's trained prefix; committed stages skip and a
finished step is not published twice. The retries are ``grpo.stage_retries`` /
``grpo.refit.retries`` per step and stage. A resumed run starts the same way: its last trained
step runs once more (what it had not finished, refit, validation, metrics line, is done).

After each step the driver hands its references to ``publish`` (the metrics line, artifacts,
trackers) and calls ``after_step`` (retention); ``fence()`` runs before each step's train and
raises when this flow may no longer write the run.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

from prefect import get_run_logger
from prefect.utilities.annotations import quote

from flows.algorithms.lanes import GenerationLane, policy_lane
from flows.algorithms.step import StepPlan, StepRefs, StepSegment, publish_step
from flows.run.recovery import RetryBudget, recover_after
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.evaluate import validate
from nrl_tasks.stages.refit import refit
from nrl_tasks.stages.schedule import Event, StepSchedule

__all__ = ["StepDriver"]

#: ``step_unit(quoted step context, plan) -> StepRefs``: a synchronous step's whole unit of work
StepUnit = Callable[[Any, StepPlan], StepRefs]
#: ``segment_unit(segment, run_one)``: runs ``run_one(step)`` for the segment's steps (a subflow)
SegmentUnit = Callable[[StepSegment, Callable[[int], None]], None]


class StepDriver:
    """Runs the steps after a run's trained prefix on its schedule (see the module docstring)."""

    def __init__(
        self,
        run: RunContext,
        plan_for: Callable[[int], StepPlan],
        *,
        step_unit: StepUnit,
        budget: RetryBudget,
        fence: Callable[[], None] | None = None,
        publish: Callable[..., Any] = publish_step,
        after_step: Callable[[int], None] | None = None,
        segment_unit: SegmentUnit | None = None,
        steps_per_segment: int = 1,
    ) -> None:
        self.run = run
        self.schedule = StepSchedule.from_config(run.cfg)
        self.plan_for = plan_for
        self.step_unit = step_unit
        self.budget = budget
        self.fence = fence
        self.publish = publish
        self.after_step = after_step
        self.segment_unit = segment_unit
        self.steps_per_segment = max(1, steps_per_segment)
        self.log: Any = None  # the run flow run's logger (set when the steps run)
        self.finished: set[int] = set()  # published in this flow process
        self.started: dict[int, float] = {}  # step -> when its first attempt began
        self.walls: dict[int, float] = {}  # step -> wall seconds, from its first attempt (recoveries included)
        self.attempts: dict[int, int] = {}  # step -> its runs (age 0, a subflow a step: the retry suffix)
        self.segment_attempts: dict[int, int] = {}  # grid cell -> its subflow runs (the retry suffix)
        self.current = 1  # the step being run (what a fault outside any stage is charged to)

    def run_from(self, trained: int) -> dict[int, float]:
        """Run steps ``trained`` (once more: its committed stages skip) to the last, recovering
        after each actor fault; the wall seconds of each step run."""
        log = self.log = get_run_logger()
        if self.schedule.lookahead:
            log.info("async GRPO schedule (age %d):\n%s", self.schedule.lookahead, self.schedule.timeline())
        held = trained  # the generation workers hold the trained prefix
        while True:
            lane = GenerationLane(self.run)
            try:
                self._run_phases(lane, max(1, held), held)
                return self.walls
            except BaseException as exc:
                lane.settle()  # recovery refits the generation workers: nothing may be generating
                err = lane.first_error() if _unfinished(exc) else None
                step = self.run.last_failure[0] if self.run.last_failure else self.current
                held = recover_after(self.run, err or exc, self.budget, step=step, max_step=self.schedule.max_steps, log=log)

    # ------------------------------------------------------------------------------------------

    def _run_phases(self, lane: GenerationLane, start: int, held: int) -> None:
        """The schedule's phases from train ``start`` on, the generation workers holding ``held``
        (steps before ``start`` are trained, their generations done)."""
        trained: dict[int, Any] = {}
        for phase in self.schedule.phases():
            todo = [e for e in phase if e.kind == "train" and e.step >= start and e.step not in self.finished]
            if not self.schedule.lookahead:  # age 0: the phases of a step are one unit
                for e in todo:
                    self._sync(e.step)
                continue
            gens = [e for e in phase if e.kind == "generate" and e.step >= start]
            if gens:
                lane.submit(gens)
            val_due: list[tuple[StepContext, dict[str, Any], Any, StepPlan, float]] = []
            for e in todo:
                ctx, plan, t0 = self._begin(e.step)
                datasets, ck = policy_lane(ctx, lane.take(e.step, self.schedule.generation_version(e.step)), plan)
                trained[e.step] = datasets["train"]
                if plan.validate:
                    val_due.append((ctx, datasets, ck, plan, t0))
                    continue
                self._finish(ctx, StepRefs(e.step, datasets, checkpoint=ck), plan, t0)
            refits = [e for e in phase if e.kind == "refit" and e.version > held]
            if val_due and not refits:  # the last steps: no generation needs their version
                refits = [Event("refit", v[0].step, v[0].step) for v in val_due]
            if refits:
                lane.settle()  # every generation on an older version is done first
                err = lane.first_error()
                if err is not None:  # a generation failed: recover before refitting its workers
                    raise err
                for e in refits:
                    result = refit(quote(self.run.step(e.step)), trained.get(e.step), e.version)
                    held = e.version
                    for ctx, datasets, ck, plan, t0 in (v for v in val_due if v[0].step == e.version):
                        val = validate(quote(ctx), result, ctx.step)
                        self._finish(ctx, StepRefs(ctx.step, datasets, refit=result, checkpoint=ck, val=val), plan, t0)

    def _sync(self, step: int) -> None:
        """Age 0: step ``step``, in its segment's subflow when steps are grouped (the segment runs
        the following steps of its grid cell too), else as its own unit."""
        if step in self.finished:  # run by the segment of an earlier step
            return
        if self.segment_unit is None:
            self._sync_step(step)
            return
        self.started.setdefault(step, time.perf_counter())  # the subflow's start is the first step's time
        k = self.steps_per_segment
        index = (step - 1) // k
        attempt = self.segment_attempts[index] = self.segment_attempts.get(index, 0) + 1
        last = min((index + 1) * k, self.schedule.max_steps)
        self.segment_unit(StepSegment(self.run.run_id, step, last, attempt), self._sync_step)

    def _sync_step(self, step: int) -> None:
        """Age 0: step ``step`` as one unit (its subflow when each step is one; ``-retryN`` when run again)."""
        ctx, plan, t0 = self._begin(step)
        attempt = self.attempts[step] = self.attempts.get(step, 0) + 1
        self._finish(ctx, self.step_unit(quote(ctx), replace(plan, attempt=attempt)), plan, t0)

    def _begin(self, step: int) -> tuple[StepContext, StepPlan, float]:
        """The start of a step's work: the fence, then its context, plan and start time."""
        if self.fence is not None:
            self.fence()
        self.current = step
        return self.run.step(step), self.plan_for(step), self.started.setdefault(step, time.perf_counter())

    def _finish(self, ctx: StepContext, refs: StepRefs, plan: StepPlan, t0: float) -> None:
        """The step's metrics line, artifacts and retention, once."""
        wall = time.perf_counter() - t0
        if self.fence is not None:  # a fenced writer writes no metrics line either
            self.fence()
        extra = {"trajectory_age": self.schedule.trajectory_age(refs.step)} if self.schedule.lookahead else None
        self.publish(ctx, refs, plan, wall_seconds=wall, extra=extra, log=self.log)
        if self.after_step is not None:
            self.after_step(refs.step)
        self.finished.add(refs.step)
        self.walls[refs.step] = wall


def _unfinished(exc: BaseException) -> bool:
    """A future whose upstream failed (``wait_for``) raises ``UnfinishedRun``: the cause is upstream."""
    from prefect.exceptions import UnfinishedRun

    return isinstance(exc, UnfinishedRun)
