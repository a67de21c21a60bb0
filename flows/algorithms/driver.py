"""The step driver: one loop that runs a run's :class:`~nrl_tasks.stages.schedule.StepSchedule`
through actor faults, for every algorithm (its recipe, :class:`flows.run.recipe.Recipe`), at age 0
and in async GRPO alike.

Every step is the recipe's stages, then the one end of a step (:func:`flows.algorithms.step.finish_step`:
the checkpoint beside the refit, validation). What differs between the modes is how the
schedule's phases are grouped into units of work:

- **age 0** (every algorithm; GRPO with ``grpo.async_grpo.enabled: false``): every step's phases
  (``gen k @v(k-1)``, ``train k``, ``refit vk``) form one unit
  (:func:`flows.algorithms.step.run_step_body`), published when done. Consecutive steps run
  grouped in one Prefect subflow (``<run_id>-steps-0001-0010``, the flow ``<kind>-steps``, steps
  on a fixed grid of ``logger.steps_per_subflow``), or each step as its own subflow
  (``<run_id>-step-0007``), or inline (``logger.step_subflows: false``). The subflow is what the
  UI shows and what a fault retries: after a fault in step 3 of ``…-steps-0001-0010`` the run
  goes on with ``…-steps-0003-0010-retry1``.
- **age a > 0** (``grpo.async_grpo``): the phases run in the run's flow, the inputs of later
  steps (GRPO's generation lane) submitted as concurrent Prefect tasks (:class:`InputLane`) while
  the policy's stages run in the flow's thread, and the refit of version ``k`` right after
  ``train(k)`` when a later generation needs ``k`` or validation is due, once every generation
  on an older version is done::

    rollouts_2 = generate.submit(ctx2, prompts_2, 0)         # generation workers, version 0
    trained_1  = train(ctx1, rollouts_1, logprobs_1, adv_1)  # policy workers, at the same time
    refit(ctx1, trained_1, 1)                                # both free: v1 to the generation workers

  Every generation runs on its scheduled version exactly (``generate`` refuses another), so the
  rollouts of a step do not depend on timing; the Prefect run graph shows the overlap with its
  data edges.

**Faults and resumes**, the same in both modes: when a stage fails on an actor fault, the driver
lets every submitted generation finish, recovers (:func:`flows.run.recovery.recover_after`: the
resume plan knows the schedule, so a step whose rollouts are missing is generated on its own
version) and runs the schedule again from the run's trained prefix; committed stages skip and a
finished step is not published twice. The retries are the recipe's, per step and stage. A
resumed run starts the same way: its last trained step runs once more (what it had not finished,
refit, validation, metrics line, is done).

After each step the driver hands its references to ``publish`` (the metrics line, artifacts,
trackers) and calls ``after_step`` (retention); ``fence()`` runs before each step's train and
raises when this flow may no longer write the run. ``before_subflow()`` runs before a step
subflow starts: the run's flow lets its background API writes (artifacts, tags, trackers) finish
first, because on Prefect's SQLite server a write committed while the subflow's tracking task
run is being created makes that creation fail with ``SQLITE_BUSY_SNAPSHOT`` (a 503 the client
retries after ~2 s).

**Early stop** (the recipe's :meth:`~flows.run.recipe.Recipe.stop_rule`, GRPO's
``grpo.stop_at_validation_metric``): after a validated step whose figure reaches the threshold no
later step runs (the rest of its segment's steps do nothing; async generations already submitted
end first). A resume of such a run runs its last step once more, as every resume does, finds the
same committed validation and stops there again: an early-stopped run stays finished.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

from prefect import get_run_logger
from prefect.exceptions import UnfinishedRun
from prefect.futures import PrefectFuture
from prefect.utilities.annotations import quote

from flows.algorithms.step import (
    StepPlan,
    StepSegment,
    finish_step,
    publish_step,
    run_step_body,
    step_flows,
    steps_per_subflow,
)
from flows.run.recipe import Recipe
from flows.run.recovery import RetryBudget, recover_after
from nrl_tasks.stages.context import RunContext
from nrl_tasks.stages.refs import StepRefs
from nrl_tasks.stages.schedule import Event

__all__ = ["InputLane", "StepDriver"]

#: ``step_unit(quoted step context, plan) -> StepRefs``: a synchronous step's whole unit of work
StepUnit = Callable[[Any, StepPlan], StepRefs]
#: ``segment_unit(segment, run_one)``: runs ``run_one(step)`` for the segment's steps (a subflow)
SegmentUnit = Callable[[StepSegment, Callable[[int], None]], None]


class InputLane:
    """The inputs of later steps (GRPO's generation lane) submitted as concurrent Prefect tasks,
    in step order (each waits for the one before: one set of generation workers), for the
    driver's async schedule: ``{step: {dataset: future or reference}}``."""

    def __init__(self, run: RunContext, recipe: Recipe) -> None:
        self.run, self.recipe = run, recipe
        self.pending: dict[int, dict[str, Any]] = {}
        self.futures: list[PrefectFuture] = []

    def submit(self, events: list[Event]) -> None:
        for e in events:
            after = self.futures[-1] if self.futures else None
            out = self.recipe.submit_inputs(self.run.step(e.step), e.version, after)
            self.pending[e.step] = out
            self.futures += [v for v in out.values() if isinstance(v, PrefectFuture)]

    def take(self, step: int, version: int) -> dict[str, Any]:
        """The step's inputs (its stages inline when not submitted: a step trained before the
        resume, whose datasets are committed and skip)."""
        if step in self.pending:
            return {k: v.result() if isinstance(v, PrefectFuture) else v for k, v in self.pending.pop(step).items()}
        return self.recipe.inputs(self.run.step(step), version)

    def settle(self) -> None:
        """Wait until every submitted task has finished (failed or not)."""
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

    def settled(self) -> None:
        """:meth:`settle`, then raise the first submitted task's error (recovery comes before the
        workers that failed are refitted)."""
        self.settle()
        err = self.first_error()
        if err is not None:
            raise err


class StepDriver:
    """Runs the steps after a run's trained prefix on its schedule (see the module docstring)."""

    def __init__(
        self,
        run: RunContext,
        recipe: Recipe,
        plan_for: Callable[[int], StepPlan],
        *,
        budget: RetryBudget,
        fence: Callable[[], None] | None = None,
        publish: Callable[..., Any] | None = None,
        after_step: Callable[[int], None] | None = None,
        before_subflow: Callable[[], None] | None = None,
    ) -> None:
        self.run = run
        self.recipe = recipe
        self.schedule = recipe.schedule(run.cfg)
        self.plan_for = plan_for
        self.budget = budget
        self.fence = fence
        self.publish = publish or (lambda ctx, refs, plan, **kw: publish_step(ctx, refs, plan, recipe, **kw))
        self.after_step = after_step
        self.before_subflow = before_subflow or (lambda: None)
        self.step_unit, self.segment_unit, self.steps_per_segment = self._units()
        self.log: Any = None  # the run flow run's logger (set when the steps run)
        self.finished: set[int] = set()  # published in this flow process
        self.started: dict[int, float] = {}  # step -> when its first attempt began
        self.walls: dict[int, float] = {}  # step -> wall seconds, from its first attempt (recoveries included)
        self.attempts: dict[int, int] = {}  # step -> its runs (age 0, a subflow a step: the retry suffix)
        self.segment_attempts: dict[int, int] = {}  # grid cell -> its subflow runs (the retry suffix)
        self.current = 1  # the step being run (what a fault outside any stage is charged to)
        #: versions a scheduled refit sends (async: the versions a later generation needs)
        self.refits = {e.version for e in self.schedule.events() if e.refits}
        self.stop_rule = recipe.stop_rule(run.cfg)
        #: (step, why) once a validation reached the recipe's early stop: no later step runs
        self.stopped: tuple[int, str] | None = None

    def _units(self) -> tuple[StepUnit, SegmentUnit | None, int]:
        """How synchronous steps run (``logger.step_subflows``, ``logger.steps_per_subflow``):
        grouped in subflows (the default: at most :data:`~flows.algorithms.step.SUBFLOWS_PER_FLOW_RUN`
        a flow run), one subflow a step, or inline in the run's flow run."""
        one, segment = step_flows(self.recipe)
        lg = self.run.cfg.logger

        def inline(ctx: Any, plan: StepPlan) -> StepRefs:  # the body in the run's flow run
            return run_step_body(self.recipe, ctx.unquote() if hasattr(ctx, "unquote") else ctx, plan)

        if not lg.step_subflows:
            return inline, None, 1
        k = steps_per_subflow(lg.steps_per_subflow, self.schedule.max_steps)
        return (self._subflow(one), None, 1) if k == 1 else (inline, self._subflow(segment), k)

    def _subflow(self, unit: Callable[..., Any]) -> Callable[..., Any]:
        """``unit`` (a subflow) started after ``before_subflow()``."""

        def start(*args: Any) -> Any:
            self.before_subflow()
            return unit(*args)

        return start

    def run_from(self, trained: int) -> dict[int, float]:
        """Run steps ``trained`` (once more: its committed stages skip) to the last, recovering
        after each actor fault; the wall seconds of each step run."""
        log = self.log = get_run_logger()
        if self.schedule.lookahead:
            log.info("async schedule (age %d):\n%s", self.schedule.lookahead, self.schedule.timeline())
        held = trained  # the generation workers hold the trained prefix
        while True:
            lane = InputLane(self.run, self.recipe)
            try:
                self._run_phases(lane, max(1, held))
                if self.stopped is not None:
                    lane.settle()  # async: generations submitted ahead of the stop end before the run does
                return self.walls
            except BaseException as exc:
                lane.settle()  # recovery refits the generation workers: nothing may be generating
                err = lane.first_error() if isinstance(exc, UnfinishedRun) else None  # the cause is upstream
                step = self.run.last_failure[0] if self.run.last_failure else self.current
                held = recover_after(self.run, self.recipe, err or exc, self.budget, step=step,
                                     max_step=self.schedule.max_steps, log=log)

    # ------------------------------------------------------------------------------------------

    def _run_phases(self, lane: InputLane, start: int) -> None:
        """The schedule's phases from train ``start`` on (steps before ``start`` are trained,
        their generations done)."""
        for phase in self.schedule.phases():
            if self.stopped is not None:
                return
            todo = [e for e in phase if e.trains and e.step >= start and e.step not in self.finished]
            if not self.schedule.lookahead:  # age 0: the phases of a step are one unit
                for e in todo:
                    self._sync(e.step)
                continue
            gens = [e for e in phase if e.generates and e.step >= start]
            if gens:
                lane.submit(gens)
            for e in todo:
                if self.stopped is not None:
                    return
                ctx, plan, t0 = self._begin(e.step)
                datasets = self.recipe.update(ctx, lane.take(e.step, self.schedule.generation_version(e.step)))
                refit = self.recipe.actors.generation and (e.step in self.refits or plan.validate)
                refs = finish_step(self.recipe, ctx, datasets, plan, refit=refit, before_refit=lane.settled)
                self._finish(ctx, refs, plan, t0)

    def _sync(self, step: int) -> None:
        """Age 0: step ``step``, in its segment's subflow when steps are grouped (the segment runs
        the following steps of its grid cell too), else as its own unit."""
        if step in self.finished or self.stopped is not None:  # run by the segment of an earlier step; stopped
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
        """Age 0: step ``step`` as one unit (its subflow when each step is one; ``-retryN`` when run again);
        nothing once the run stopped early (the rest of a segment's steps)."""
        if self.stopped is not None:
            return
        ctx, plan, t0 = self._begin(step)
        attempt = self.attempts[step] = self.attempts.get(step, 0) + 1
        self._finish(ctx, self.step_unit(quote(ctx), replace(plan, attempt=attempt)), plan, t0)

    def _begin(self, step: int) -> tuple[Any, StepPlan, float]:
        """The start of a step's work: the fence, then its context, plan and start time."""
        if self.fence is not None:
            self.fence()
        self.current = step
        return self.run.step(step), self.plan_for(step), self.started.setdefault(step, time.perf_counter())

    def _finish(self, ctx: Any, refs: StepRefs, plan: StepPlan, t0: float) -> None:
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
        if self.stop_rule is not None and plan.validate and refs.val is not None:
            why = self.stop_rule.reached(refs.val.summary())
            if why is not None:
                self.stopped = (refs.step, why)
                self.log.info("step %d: %s", refs.step, why)
