"""Carrying out a resume plan, and running steps through actor faults.

:func:`recover` probes the actors, asks :func:`~nrl_tasks.stages.resume_plan.plan_resume` what to
do and :func:`execute_plan` does it, in the plan's order: re-create dead actor groups, restore the
anchor checkpoint (or the initial weights), replay the ``train`` of each later step from its
persisted batches (recomputing its missing datasets first with the step's own stages, the
generation workers refitted to that step's weights), then refit the generation workers to the
run's version. It runs at the start of every run (a resume, a Prefect retry, a fresh run: then it
finds nothing to do) and after every actor fault.

:func:`run_step` runs one step's subflow; when a stage fails on an actor fault it waits the
stage's retry delay, recovers and runs the step again (its committed stages skip), at most
``grpo.stage_retries`` times per stage and step (``grpo.refit.retries`` for the refit, which is
retried on any failure but a metadata mismatch). Recovery is never inside a task and no task
retries inside another: the flow decides, in one place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError
from prefect.utilities.annotations import quote

from flows.runtime import recreate_generation, recreate_policy
from nrl_tasks.stages.context import RunContext
from nrl_tasks.stages.errors import exception_chain, is_actor_fault
from nrl_tasks.stages.graph import RETRIED_STAGES, STAGES
from nrl_tasks.stages.health import probe_actors
from nrl_tasks.stages.refs import StepRefs
from nrl_tasks.stages.resume_plan import ResumePlan, plan_resume, read_run_facts

__all__ = ["RetryBudget", "execute_plan", "recover", "run_step"]

#: Actions retried on actor faults besides the retried data stages.
_RETRIED_ACTIONS = ("checkpoint", "validate")


def _logger() -> Any:
    """Prefect's run logger inside a flow run, this module's logger elsewhere (a test, a script)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def execute_plan(run: RunContext, plan: ResumePlan, *, log: Any = None) -> dict[str, Any]:
    """Carry out ``plan`` on the run's actors (see the module docstring); what was done."""
    from flows.step import data_stages
    from nrl_tasks.stages.checkpoint import restore_checkpoint
    from nrl_tasks.stages.refit import refit
    from nrl_tasks.stages.train import replay_train

    log = log or _logger()
    if not plan.touches_actors:
        return {"restored_from": "live", "replayed": [], "recomputed": {}}
    log.info("recovery: %s", plan.describe())
    # what the next commit of every stage records (recomputed datasets below included)
    note = {"recovered": True, "replayed": ",".join(map(str, plan.replay))}
    run.recovery_notes = {spec.name: dict(note) for spec in STAGES}
    actors = run.actors
    if plan.recreate_generation:
        recreate_generation(actors, "a worker is dead or does not answer", log)
    if plan.recreate_policy:
        recreate_policy(actors, "; ".join(plan.reasons) or "restore to the initial weights", log)
    restored = "live"
    if plan.restore_from is not None:
        restored = "initial"
        if plan.restore_from > 0:
            restored = run.layout.checkpoint_uri(plan.restore_from)
            info = restore_checkpoint(run.policy, restored, run.storage_options)
            log.info("restored checkpoint %s (weights version %d)", restored, int(info["step"]))
    for s in plan.replay:
        t = time.perf_counter()
        if s in plan.recompute:
            log.warning("recomputing %s of trained step %d before replaying it", list(plan.recompute[s]), s)
            ctx = run.step(s)
            refit(quote(ctx), None, s - 1, force=True)
            data_stages(ctx, s - 1)
        replay_train(run, s)
        log.info("replayed train of step %d from persisted batches (%.2fs)", s, time.perf_counter() - t)
    if plan.refit:
        refit(quote(run.step(plan.target)), None, plan.target, force=True)
    return {"restored_from": restored, "replayed": list(plan.replay), "recomputed": dict(plan.recompute)}


def recover(run: RunContext, max_step: int, *, force_refit: bool = False, policy_fresh: bool = False, log: Any = None) -> dict[str, Any]:
    """Probe, plan and execute: afterwards the policy holds the run's weights after its last
    trained step (at most ``max_step``) and the generation workers hold that version."""
    facts = read_run_facts(run.layout, run.storage_options, max_step=max_step)
    health = probe_actors(run.actors, target=facts.last_trained, policy_fresh=policy_fresh)
    plan = plan_resume(facts, health, force_refit=force_refit)
    return {"plan": plan, **execute_plan(run, plan, log=log)}


class RetryBudget:
    """Retries left per ``(step, stage)`` and the delay before each (the run's retry settings)."""

    def __init__(self, cfg: Any) -> None:
        g = cfg.grpo
        self._limits = {"refit": (int(g.refit.retries), _delays(g.refit.retry_delay_s))}
        self._default = (int(g.stage_retries), _delays(g.stage_retry_delay_s))
        self.used: dict[tuple[int, str], int] = {}

    def retryable(self, stage: str, exc: BaseException) -> bool:
        if stage == "refit":
            from nrl_tasks.utils.refit import RefitMismatchError

            return not any(isinstance(e, RefitMismatchError) for e in exception_chain(exc))
        return (stage in RETRIED_STAGES or stage in _RETRIED_ACTIONS) and is_actor_fault(exc)

    def take(self, step: int, stage: str) -> float | None:
        """Use one retry of ``(step, stage)``: the delay to wait, ``None`` when none is left."""
        limit, delays = self._limits.get(stage, self._default)
        n = self.used.get((step, stage), 0) + 1
        if n > limit:
            return None
        self.used[(step, stage)] = n
        return delays[min(n, len(delays)) - 1] if delays else 0.0


def _delays(value: Any) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)]
    return [float(v) for v in value]


def run_step(run: RunContext, step: int, call: Callable[[int], StepRefs], budget: RetryBudget, *, log: Any = None) -> StepRefs:
    """``call(attempt)`` (the step's subflow) until it succeeds, recovering after each actor fault."""
    log = log or _logger()
    attempt = 1
    while True:
        run.last_failure = None
        try:
            return call(attempt)
        except BaseException as exc:
            where = run.last_failure or (step, "step")
            delay = budget.take(*where) if budget.retryable(where[1], exc) else None
            if delay is None:
                raise
            log.warning(
                "step %d: %s failed (%s: %s); recovering and running the step again in %.1fs",
                step, where[1], type(exc).__name__, str(exc)[:300], delay,
            )
        time.sleep(delay)
        while True:  # recovery itself may meet a fault: re-plan within the same budget
            run.last_failure = None
            try:
                recover(run, step, log=log)
                break
            except BaseException as exc:
                where = run.last_failure or (step, where[1])
                delay = budget.take(*where) if budget.retryable(where[1], exc) else None
                if delay is None:
                    raise
                log.warning("step %d: recovery failed (%s: %s); trying again in %.1fs", step, type(exc).__name__, exc, delay)
                time.sleep(delay)
        attempt += 1
