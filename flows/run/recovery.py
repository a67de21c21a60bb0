"""Carrying out a resume plan, and running steps through actor faults.

:func:`recover` probes the actors, asks :func:`~nrl_tasks.stages.resume_plan.plan_resume` what to
do and :func:`execute_plan` does it, in the plan's order: re-create dead actor groups, uncommit
damaged checkpoints, restore the anchor checkpoint (or the initial weights), replay the ``train``
of each later step from its persisted batches (the run's recipe's one update,
:class:`flows.run.recipe.Recipe`; its missing datasets made again first by the recipe's own
stages, the generation workers refitted to that step's weights; a discarded checkpoint is saved
anew once its step is replayed), then refit the generation workers, when the recipe has them, to
the run's version. Nothing here names an algorithm: what differs is the recipe's. It runs at the start of every run (a resume, a Prefect retry, a fresh run: then it
finds nothing to do) and after every actor fault.

**Restore verification.** Before a plan restores a checkpoint, :func:`recover` reads the facts
again with the checkpoints' files checked (sizes and checksums against ``checkpoint.json``), so the
plan falls back to the newest intact one by itself. After loading, :func:`execute_plan` compares
the policy's weights checksum with the one the step's ``train`` recorded; on a mismatch (or a
file that changed since) it raises :class:`~nrl_tasks.stages.checkpoint_files.CheckpointDamagedError`
and :func:`recover` plans again with that checkpoint counted as damaged: an older one, or the
initial weights, and a replay of every later step (each verified by its recorded checksum). When
no fallback can be carried out the plan stops with an error naming the damaged file. A checkpoint
written before file manifests is checked after loading only, which the log says.

:func:`recover` also rebuilds lost or damaged ``metrics.jsonl`` lines of the steps before the
last trained one from the committed datasets (:func:`flows.observe.metrics.repair_metrics`; the last
trained step runs again and writes its own).

:func:`run_step` runs one step's subflow; when a stage fails on an actor fault it waits the
stage's retry delay, recovers and runs the step again (its committed stages skip), at most as
often per stage and step as the recipe's retry settings say (GRPO: ``grpo.stage_retries``,
``grpo.refit.retries`` for the refit, which is retried on any failure but a metadata mismatch). Recovery is never inside a task and no task
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

import storage
from flows.config import MasterConfig
from flows.observe.metrics import repair_metrics
from flows.run.hints import resume_command
from flows.run.recipe import Recipe, Retries
from flows.run.runtime import recreate_generation, recreate_policy
from nrl_tasks.config.hash import config_hash
from nrl_tasks.stages.checkpoint import (
    checkpoint_info,
    discard_checkpoint,
    has_optimizer_state,
    restore_checkpoint,
    save_checkpoint,
    trained_models,
)
from nrl_tasks.stages.checkpoint_files import CheckpointDamagedError
from nrl_tasks.stages.context import RunContext
from nrl_tasks.stages.errors import MissingOptimizerStateError, exception_chain, is_actor_fault
from nrl_tasks.stages.graph import RETRIED_STAGES
from nrl_tasks.stages.health import probe_actors
from nrl_tasks.stages.refit import refit
from nrl_tasks.stages.refs import StepRefs
from nrl_tasks.stages.resume_plan import ResumePlan, plan_resume, read_run_facts
from nrl_tasks.stages.train import replay_train
from nrl_tasks.utils.refit import RefitMismatchError, checksum_algorithm

__all__ = ["RetryBudget", "execute_plan", "recover", "recover_after", "run_step"]

#: Actions retried on actor faults besides the retried data stages.
_RETRIED_ACTIONS = ("checkpoint", "validate")


def _logger() -> Any:
    """Prefect's run logger inside a flow run, this module's logger elsewhere (a test, a script)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def execute_plan(
    run: RunContext, plan: ResumePlan, recipe: Recipe, *, log: Any = None, verified: bool = False,
    optimizer_required: bool = False,
) -> dict[str, Any]:
    """Carry out ``plan`` on the run's actors (see the module docstring); what was done.

    ``verified``: the checkpoint to restore had its files checked just now (else the restore
    checks them). ``CheckpointDamagedError`` when a file or the loaded weights are not what the
    checkpoint and its step recorded. ``optimizer_required``: training follows the restore, so a
    checkpoint without optimizer state is a ``MissingOptimizerStateError`` naming ``checkpointing.save_optimizer``
    (training on would silently differ from an uninterrupted run)."""
    log = log or _logger()
    if not plan.touches_actors:
        return {"restored_from": "live", "replayed": [], "recomputed": {}}
    log.info("recovery: %s", plan.describe())
    # what the next commit of every stage records (recomputed datasets below included)
    note = {"recovered": True, "replayed": ",".join(map(str, plan.replay))}
    run.recovery_notes = {spec.name: dict(note) for spec in recipe.graph.stages}
    actors = run.actors
    if plan.recreate_generation:
        recreate_generation(actors, "a worker is dead or does not answer", log)
    if plan.recreate_policy:
        recreate_policy(actors, "; ".join(plan.reasons) or "restore to the initial weights", log)
        if trained_models(run):  # PPO's value model goes back with the policy (initial weights, then the restore)
            actors.start_value(fresh=True)
    for s, problem in sorted(plan.discard.items()):
        uri = run.layout.checkpoint_uri(s)
        discard_checkpoint(uri, problem, run.storage_options)
        log.warning("discarded damaged checkpoint %s (%s): its step's next checkpoint replaces it", uri, problem)
    restored, unlisted = "live", False
    if plan.restore_from is not None:
        restored = "initial"
        if plan.restore_from > 0:
            restored = run.layout.checkpoint_uri(plan.restore_from)
            info = restore_checkpoint(run.policy, restored, run.storage_options, verify=not verified,
                                      extra=trained_models(run))
            _check_restored_weights(run, plan, restored, info, log)
            if optimizer_required:
                _check_optimizer_restored(run, restored, info)
            unlisted = not isinstance(info.get("files"), dict)
            log.info("restored checkpoint %s (weights version %d)", restored, int(info["step"]))
    held = plan.restore_from if plan.restore_from is not None else plan.target
    for s in (*plan.replay, None):  # the policy holds version ``held`` here
        _generate_on(run, plan, recipe, held, log)
        if s is None:
            break
        t = time.perf_counter()
        if s in plan.recompute:
            log.warning("recomputing %s of trained step %d before replaying it", list(plan.recompute[s]), s)
            recipe.recompute(run, s, plan_generation_version(plan, s))
        try:
            replay_train(run, s, recipe.graph.replay_inputs, recipe.train_once)
        except RuntimeError as exc:
            if unlisted and s == plan.replay[0] and not is_actor_fault(exc):
                # the optimizer and RNG states of a checkpoint without file manifest were not
                # verified: blame the checkpoint first (recovery then tries an older one)
                raise CheckpointDamagedError(
                    plan.restore_from, restored, f"the first replay from it failed ({exc}); its optimizer and RNG "
                    "states are not covered by a file manifest",
                ) from exc
            raise
        log.info("replayed train of step %d from persisted batches (%.2fs)", s, time.perf_counter() - t)
        held = s
        if s in plan.discard:  # the policy holds that step's weights again: write its checkpoint anew
            _resave_checkpoint(run, s, log)
    if plan.refit and recipe.actors.generation:
        refit(quote(run.step(plan.target)), None, plan.target, force=True)
    return {"restored_from": restored, "replayed": list(plan.replay), "recomputed": dict(plan.recompute)}


def _check_optimizer_restored(run: RunContext, uri: str, info: dict[str, Any]) -> None:
    """``MissingOptimizerStateError`` when checkpoint ``uri`` (restored inside a run, e.g. after an actor fault)
    held no optimizer state: the steps trained on would differ from an uninterrupted run's without
    saying so. The run stops; ``nrl resume RUN --fresh-optimizer`` continues it, recorded
    (:func:`flows.run.start.check_optimizer_state`)."""
    if has_optimizer_state(uri, info, run.storage_options):
        return
    raise MissingOptimizerStateError(
        f"run {run.run_id!r}: recovery restored checkpoint {uri}, which holds no optimizer state (the run has "
        "checkpointing.save_optimizer = false): training on would differ from an uninterrupted run, so the run "
        f"stops here. To continue anyway, resume with {resume_command(run.run_id, '--fresh-optimizer')} (recorded as "
        "optimizer_reset in status.json and in the metrics line of the first step trained)"
    )


def _resave_checkpoint(run: RunContext, step: int, log: Any) -> None:
    """Save the checkpoint of ``step`` again (it was discarded as damaged and its ``train`` was just
    replayed, verified against the recorded weights checksum when there is one): otherwise only the
    last trained step's checkpoint would ever be written anew, and an older damaged one stayed lost."""
    uri = run.layout.checkpoint_uri(step)
    meta = storage.read_manifest(run.layout.stage_uri(step, "train"), **run.storage_kw).meta
    info = checkpoint_info(run, step, step, config_hash(run.cfg), meta.get("weights_checksum"))
    save_checkpoint(run.policy, uri, info, save_optimizer=run.cfg.checkpointing.save_optimizer,
                    storage_options=run.storage_options, on_written=run.check_fence, extra=trained_models(run))
    log.warning("re-saved checkpoint %s (discarded as damaged) from the replayed train of step %d", uri, step)


def plan_generation_version(plan: ResumePlan, step: int) -> int:
    """The weights version ``step``'s rollouts are generated on in ``plan`` (``step - 1`` when
    the plan does not generate it: its rollouts are committed, sync or async)."""
    return next((v for v, steps in plan.generate_at.items() if step in steps), step - 1)


def _generate_on(run: RunContext, plan: ResumePlan, recipe: Recipe, version: int, log: Any) -> None:
    """Run the recipe's stages before the policy's (``recipe.inputs``: GRPO's generation lane) of
    the steps ``plan`` generates on ``version``, the generation workers refitted to it first (the
    policy holds it now)."""
    steps = plan.generate_at.get(version, ())
    if not steps:
        return
    refit(quote(run.step(steps[0])), None, version, force=True)
    for s in steps:
        log.warning("generating the rollouts of step %d on weights version %d (its scheduled version)", s, version)
        recipe.inputs(run.step(s), version)


def _check_restored_weights(run: RunContext, plan: ResumePlan, uri: str, info: dict[str, Any], log: Any) -> None:
    """The restored policy must hold the weights checksum recorded for the checkpoint's step
    (by its ``train``; else by ``checkpoint.json``)."""
    step = int(plan.restore_from or 0)
    want = plan.restore_checksum or info.get("weights_checksum")
    legacy = not isinstance(info.get("files"), dict)
    if not want:
        log.warning(
            "checkpoint %s: no weights checksum recorded for step %d (logger.weights_checksum=false): the weights "
            "restored are %s", uri, step, "unverified" if legacy else "checked against the file checksums only",
        )
        return
    got = run.policy.weights_checksum(algorithm=checksum_algorithm(want))
    if got != want:
        raise CheckpointDamagedError(
            step, uri, f"the weights loaded from {uri}/weights have checksum {got}, step {step} recorded {want}"
        )
    if legacy:
        log.warning(
            "checkpoint %s has no file manifest (written before checkpoints listed their files): only the "
            "weights checksum after loading was verified (it matches step %d's), not the optimizer state", uri, step,
        )


def recover(
    run: RunContext, recipe: Recipe, max_step: int, *, force_refit: bool = False, policy_fresh: bool = False,
    log: Any = None, fresh_optimizer_at: int | None = None,
) -> dict[str, Any]:
    """Probe, plan and execute: afterwards the policy holds the run's weights after its last
    trained step (at most ``max_step``) and the generation workers hold that version.
    ``fresh_optimizer_at``: the checkpoint a ``--fresh-optimizer`` start may restore without
    optimizer state; any other such restore that training follows stops the run (:func:`execute_plan`).

    A plan that restores a checkpoint is made from facts with the checkpoints' files checked;
    a checkpoint found damaged by the restore (its loaded weights) is counted as such and the
    run planned again (see the module docstring)."""
    log = log or _logger()
    damaged: dict[int, str] = {}
    ahead = recipe.facts_options(run.cfg)  # async GRPO: the steps generated ahead on older weights are facts too
    while True:
        facts = read_run_facts(run.layout, run.storage_options, max_step=max_step, damaged=damaged, **ahead)
        health = probe_actors(run.actors, target=facts.last_trained, policy_fresh=policy_fresh,
                              checksum_algorithm=checksum_algorithm(facts.checksums.get(facts.last_trained)),
                              with_generation=recipe.actors.generation)
        plan = plan_resume(facts, health, force_refit=force_refit)
        verified = False
        if plan.restore_from:  # about to load a checkpoint: check its files first
            facts = read_run_facts(
                run.layout, run.storage_options, max_step=max_step, damaged=damaged, verify_checkpoints=True, **ahead
            )
            plan = plan_resume(facts, health, force_refit=force_refit)
            verified = True
        try:
            trains = bool(plan.replay) or facts.last_trained < max_step
            required = trains and plan.restore_from != fresh_optimizer_at
            done = execute_plan(run, plan, recipe, log=log, verified=verified, optimizer_required=required)
            break
        except CheckpointDamagedError as exc:
            if exc.step in damaged or exc.step != plan.restore_from:
                raise
            log.warning("%s; planning the recovery again without it", exc)
            damaged[exc.step] = exc.problem
            policy_fresh = False  # the policy now holds the damaged checkpoint's weights
    repair_metrics(run.layout, facts.last_trained - 1, run.storage_options, rebuild=recipe.rebuild_line, log=log)
    return {"plan": plan, **done}


class RetryBudget:
    """Retries left per ``(step, stage)`` and the delay before each: ``retries`` (the run's retry
    settings), ``retried``: the data stages an actor fault is worth a retry of (its recipe's graph)."""

    def __init__(self, retries: Retries, retried: tuple[str, ...] = RETRIED_STAGES) -> None:
        self._limits = {"refit": (int(retries.refit), [float(d) for d in retries.refit_delays])}
        self._default = (int(retries.stage), [float(d) for d in retries.stage_delays])
        self.retried = tuple(retried)
        self.used: dict[tuple[int, str], int] = {}

    @classmethod
    def for_run(cls, cfg: MasterConfig, recipe: Recipe) -> RetryBudget:
        """The budget of a run of ``recipe`` with config ``cfg``."""
        return cls(recipe.retries(cfg), recipe.graph.retried)

    def retryable(self, stage: str, exc: BaseException) -> bool:
        if any(not isinstance(e, Exception) for e in exception_chain(exc)):
            return False  # SIGINT/SIGTERM/SystemExit (user code, or Ray's handler): the process is told to stop
        if stage == "refit":
            return not any(isinstance(e, RefitMismatchError) for e in exception_chain(exc))
        return (stage in self.retried or stage in _RETRIED_ACTIONS) and is_actor_fault(exc)

    def take(self, step: int, stage: str) -> float | None:
        """Use one retry of ``(step, stage)``: the delay to wait, ``None`` when none is left."""
        limit, delays = self._limits.get(stage, self._default)
        n = self.used.get((step, stage), 0) + 1
        if n > limit:
            return None
        self.used[(step, stage)] = n
        return delays[min(n, len(delays)) - 1] if delays else 0.0


def recover_after(
    run: RunContext, recipe: Recipe, exc: BaseException, budget: RetryBudget, *, step: int, max_step: int, log: Any = None,
) -> int:
    """After ``exc`` failed ``step``: re-raise it unless the failed stage has a retry left for it;
    else wait the retry's delay and :func:`recover` the run (planning again, within the same
    budget, when recovery itself meets a fault). Returns the trained prefix recovered to."""
    log = log or _logger()
    where = run.last_failure or (step, "step")
    delay = budget.take(*where) if budget.retryable(where[1], exc) else None
    if delay is None:
        raise exc
    log.warning(
        "step %d: %s failed (%s: %s); recovering and running the step again in %.1fs",
        step, where[1], type(exc).__name__, str(exc)[:300], delay,
    )
    time.sleep(delay)
    while True:
        run.last_failure = None
        try:
            return int(recover(run, recipe, max_step, log=log)["plan"].target)
        except BaseException as again:
            where = run.last_failure or (step, where[1])
            delay = budget.take(*where) if budget.retryable(where[1], again) else None
            if delay is None:
                raise
            log.warning("step %d: recovery failed (%s: %s); trying again in %.1fs", step, type(again).__name__, again, delay)
            time.sleep(delay)


def run_step(
    run: RunContext, recipe: Recipe, step: int, call: Callable[[int], StepRefs], budget: RetryBudget, *, log: Any = None,
) -> StepRefs:
    """``call(attempt)`` (the step's subflow) until it succeeds, recovering after each actor fault."""
    log = log or _logger()
    attempt = 1
    while True:
        run.last_failure = None
        try:
            return call(attempt)
        except BaseException as exc:
            recover_after(run, recipe, exc, budget, step=step, max_step=step, log=log)
        attempt += 1
