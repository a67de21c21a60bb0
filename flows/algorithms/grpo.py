"""The GRPO flow: generate → score → logprob → advantages → train → refit, step after step.

``grpo(config, run_id=None, resume=False)`` sets up (or re-attaches to) the run's Ray actors and
loops steps. Every stage persists its output under ``<storage>/<run_id>/steps/step_N/`` and is
idempotent, so a resumed flow (``resume=True``, ``nrl resume RUN_ID`` or ``prefect flow-run
retry``) recomputes nothing that is committed. When the Policy actors are gone (a local Ray dies
with the flow process) or hold other weights than the run's trained prefix, the last checkpoint
is restored and the ``train`` stages after it are *replayed* from their persisted batches (no
regeneration). Every resume then starts the generation side with a full refit.

Without a Ray address the flow starts its own local Ray and stops it when it ends, completed or
failed (``NRL_KEEP_ACTORS=1`` keeps it); ``status.json`` records the flow process and that Ray's
session, so a resume first stops what a SIGKILLed predecessor left of it (:mod:`flows.run.process`).

Each step is a subflow ``<run_id>-step-0007`` whose stage tasks pass dataset references to each
other (:mod:`flows.algorithms.step`). A stage that fails on an actor fault fails its step; the driver recovers
(:mod:`flows.run.recovery`: one resume plan, one executor) and runs the step again, up to
``grpo.stage_retries`` / ``grpo.stage_retry_delay_s`` per stage (``grpo.refit.retries`` /
``grpo.refit.retry_delay_s`` for the refit).

With ``grpo.async_grpo.enabled`` the generation of later steps overlaps the policy's work, on
weights versions fixed by the step; one driver runs both schedules with the same recovery,
retries, metrics and retention (:mod:`flows.algorithms.driver`).

Per step: one line in ``metrics.jsonl``, the run summary artifact (:mod:`flows.observe.summary`), the
progress artifact, one INFO log line (Prefect's per-run "Finished in state Completed()" lines are
filtered: :mod:`flows.observe.quiet_logs`) and a console line; at checkpoint steps and the last step also
the metrics-table artifact (newest lines first) and the best and worst rollouts (bounded per step:
:mod:`flows.observe.artifacts`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from prefect import flow, get_run_logger
from prefect.utilities.annotations import quote

from flows.observe.artifacts import BackgroundPublisher, RunArtifacts
from flows.config import ConfigError, MasterConfig, changed_keys, config_to_yaml
from flows.observe.metrics import read_metrics
from flows.observe.quiet_logs import quiet_lifecycle_logs
from flows.config.preflight import check_plugins
from flows.run.recompute import apply_recompute, parse_recompute
from flows.run.retention import RetentionPolicy, apply_retention
from flows.algorithms.step import StepPlan, tag_flow_run
from flows.config.resolve import new_run_id, resolve_config
from flows.run.session import RunIntent, run_session, tag_this_flow_run
from flows.observe.trackers import open_trackers, publish_tracker_links
from flows.algorithms.warm_start import ensure_warm_start, with_warm_start_weights
from nrl_tasks.run_layout import validate_run_id
from nrl_tasks.stages.context import RunContext

__all__ = ["grpo", "new_run_id", "resolve_config", "run_grpo_steps"]


def resume_config(config: Any, overrides: list[str] | None, storage: str | None, run_id: str, log: Any) -> MasterConfig:
    """The config a resume runs: the run's saved ``config.yaml`` with ``overrides`` applied.

    A ``config`` passed as well (a deployment always sends its default) is ignored with a warning
    when it resolves to the same result-affecting settings; one that would change them is refused
    (``ConfigError`` naming the keys): a run keeps the config it was created with."""
    saved = resolve_config(None, overrides, storage, run_id=run_id, algorithm="grpo")
    if config is None:
        return saved
    given = with_warm_start_weights(resolve_config(config, overrides, storage or saved.storage.root), run_id)
    changed = changed_keys(saved, given)
    if changed:
        raise ConfigError(
            f"resume of run {run_id!r}: the config parameter changes the run's saved config in {', '.join(changed[:12])}"
            f"{' ...' if len(changed) > 12 else ''}; resume without it (the run's config.yaml is used, with the overrides)"
        )
    log.warning("resume of run %s: the config parameter is ignored; the run's saved config.yaml is used (with the "
                "overrides %s)", run_id, list(overrides or []))
    return saved


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    rid = params.get("run_id") or new_run_id()
    return f"{rid}-resume" if params.get("resume") else str(rid)


# ----------------------------------------------------------------------------------------------
# the steps


def _due(period: int, step: int, last: int) -> bool:
    return step % period == 0 or step == last


def step_plan(cfg: MasterConfig, step: int, *, chash: str, write_line: bool = True, attempt: int = 1) -> StepPlan:
    """What step ``step`` does besides its data stages (checkpoint / validation when due)."""
    max_steps = cfg.grpo.max_num_steps
    return StepPlan(
        max_steps=max_steps,
        config_hash=chash,
        checkpoint=bool(cfg.checkpointing.enabled and _due(cfg.checkpointing.save_period, step, max_steps)),
        validate=bool(cfg.grpo.val_period and step % cfg.grpo.val_period == 0),
        write_line=write_line,
        attempt=attempt,
    )


def run_grpo_steps(
    run: RunContext, *, chash: str, refit_generation: bool, policy_fresh: bool = False, fence: Callable[[], None] | None = None,
    optimizer_reset: int | None = None, history: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Recover, then run the steps of a run on its schedule (the body of the flow). ``history``:
    the run's history (``status.json``), shown in the run summary. ``fence()``
    runs before each step and raises when this flow may no longer write the run (its lease was
    taken over). ``optimizer_reset``: the checkpoint restored without optimizer state
    (``--fresh-optimizer``; any other such restore stops the run): the metrics line of the first
    step trained says ``optimizer_reset: true``.

    One driver (:class:`flows.algorithms.driver.StepDriver`) runs synchronous GRPO (the schedule
    with age 0: each step one subflow, :func:`flows.algorithms.step.grpo_step`, the unit a fault
    retries) and async GRPO alike, recovering after actor faults. The last trained step of a
    resumed run runs once more (its stages are committed and skip; what it had not finished,
    checkpoint, refit, validation, metrics line, is done)."""
    from flows.algorithms.driver import StepDriver
    from flows.algorithms.step import publish_step, without_subflow_heartbeats
    from flows.run.recovery import RetryBudget, recover, run_step
    from nrl_tasks.stages.evaluate import validate

    cfg = run.cfg
    logger = get_run_logger()
    layout, opts = run.layout, run.storage_options
    restored = recover(run, cfg.grpo.max_num_steps, force_refit=refit_generation, policy_fresh=policy_fresh, log=logger,
                       fresh_optimizer_at=optimizer_reset)
    last = restored["plan"].target
    if restored["restored_from"] == "live" and last > 0 and getattr(run.actors, "policy_attached", False):
        logger.info("attached to live policy actors at weights version %d", last)
    retention = RetentionPolicy.from_config(cfg)  # never deletes what a resume reads
    budget = RetryBudget(cfg)
    pruned: set[int] = set()  # steps retention found without batches (inspected once per run)
    artifacts = RunArtifacts(run.run_id, history)  # one of each kind, updated in place
    publisher = BackgroundPublisher()
    lines = read_metrics(layout.metrics_uri, opts)
    have_lines = {int(r["step"]) for r in lines}
    trackers = open_trackers(cfg, run.run_id, config_to_yaml(cfg))  # flows.observe.trackers: curves, resumed in place
    publisher.submit(trackers.sync, lines)  # what a crash kept from them
    publisher.submit(publish_tracker_links, trackers.links(), run.run_id)  # e.g. the MLflow run, as a link artifact

    tagged: set[str] = set()  # subflows tagged run:<id> (a segment's steps share one)

    def publish(ctx: Any, refs: Any, plan: StepPlan, **kw: Any) -> Any:
        if refs.flow_run_id and refs.flow_run_id not in tagged:
            tagged.add(refs.flow_run_id)
            publisher.submit(tag_flow_run, refs.flow_run_id, run.run_id)
        if optimizer_reset is not None and refs.step == last + 1:  # the first step trained with a fresh optimizer
            kw["extra"] = {**(kw.get("extra") or {}), "optimizer_reset": True}
        return publish_step(ctx, refs, plan, publisher=publisher, artifacts=artifacts, trackers=trackers, **kw)

    # async GRPO: a resume may need the checkpoint at or before version step - age (the steps
    # generated ahead on older weights): retention keeps what that resume reads
    age = cfg.grpo.async_grpo.max_trajectory_age_steps if cfg.grpo.async_grpo.enabled else 0
    driver = StepDriver(
        run, lambda s: step_plan(cfg, s, chash=chash, write_line=s not in have_lines),
        budget=budget, fence=fence, publish=publish, **_step_units(cfg),
        after_step=lambda s: apply_retention(layout, retention, max(0, s - age), opts, pruned=pruned),
    )
    try:
        if last == 0 and cfg.grpo.val_at_start and cfg.grpo.val_period:
            run_step(run, 0, lambda attempt: validate(quote(run.step(0)), None, 0), budget, log=logger)
        loop_t0 = time.perf_counter()
        with without_subflow_heartbeats():  # the step subflows (flows.algorithms.step): no ~0.9 s heartbeat join each
            walls = driver.run_from(last)
    finally:
        publisher.close()
        trackers.close()
    return {"restored": {k: v for k, v in restored.items() if k != "plan"}, "first_step": last + 1,
            "step_wall_s": [w for s, w in sorted(walls.items()) if s > last], "loop_s": time.perf_counter() - loop_t0}


def _step_units(cfg: Any) -> dict[str, Any]:
    """How the driver runs synchronous steps (``logger.step_subflows``, ``logger.steps_per_subflow``):
    grouped in subflows (the default: at most :data:`~flows.algorithms.step.SUBFLOWS_PER_FLOW_RUN`
    a flow run), one subflow a step, or inline in the run's flow run."""
    from flows.algorithms.step import grpo_step, grpo_steps, steps_per_subflow

    if not cfg.logger.step_subflows:
        return {"step_unit": _inline(grpo_step.fn)}
    k = steps_per_subflow(cfg.logger.steps_per_subflow, cfg.grpo.max_num_steps)
    if k == 1:
        return {"step_unit": grpo_step}
    return {"step_unit": _inline(grpo_step.fn), "segment_unit": grpo_steps, "steps_per_segment": k}


def _inline(fn: Any) -> Any:
    """``grpo_step``'s body called in the run's flow run (the context arrives quoted, as Prefect
    would hand it over unwrapped)."""

    def call(ctx: Any, plan: StepPlan) -> Any:
        return fn(ctx.unquote() if hasattr(ctx, "unquote") else ctx, plan)

    return call


@flow(name="grpo", flow_run_name=_flow_run_name, validate_parameters=False, persist_result=False)
def grpo(
    config: str | dict | None = None,
    run_id: str | None = None,
    resume: bool = False,
    overrides: list[str] | None = None,
    storage: str | None = None,
    recompute: list[str] | None = None,
    take_over: bool = False,
    fresh_optimizer: bool = False,
) -> dict[str, Any]:
    """Train with GRPO.

    The flow holds the run's lease (:mod:`flows.run.lease`) from before its first write to its
    end. Returns ``{"run_id", "run_uri", "last_step", "metrics_uri", "checkpoints", "final_metrics"}``.

    Args:
        config: YAML config path (e.g. configs/grpo_tiny.yaml), a dict or a MasterConfig. Ignored
            (with a warning) when resuming: the run keeps its saved config.yaml; refused if it
            would change the run's result-affecting settings.
        run_id: the run's id (default: a new one); with resume, the run to continue.
        resume: continue the run from its persisted batches and checkpoints (e.g. extend a
            finished run with overrides=["grpo.max_num_steps=70"]).
        overrides: dotted key=value overrides, e.g. ["grpo.max_num_steps=70", "policy.optimizer.kwargs.lr=1e-5"].
        storage: storage root holding the runs: a local path, file:// or s3://bucket/prefix.
        recompute: with resume, STAGE@STEP items to recompute (e.g. ["generate@3"]).
        take_over: take the run's lease from a holder that looks live but is gone (its machine died).
        fresh_optimizer: with resume, train on from a checkpoint saved without optimizer state
            (checkpointing.save_optimizer=false; refused otherwise), recorded as optimizer_reset.
    """
    given = run_id
    run_id = validate_run_id(run_id) if run_id else new_run_id()
    tag_this_flow_run(run_id)  # before the config is read: a flow run refused for its config is tagged too
    if resume and given:
        cfg = resume_config(config, overrides, storage, run_id, get_run_logger())
    else:
        cfg = resolve_config(config, overrides, storage, algorithm="grpo")
    specs = parse_recompute(recompute)
    if specs and not resume:
        raise ValueError("recompute needs resume=True")
    check_plugins(cfg)  # before the lease, the run's directory and Ray (a deployment run skips the CLI's preflight)
    log = get_run_logger()
    intent = RunIntent(resume=resume, take_over=take_over, fresh_optimizer=fresh_optimizer)
    with quiet_lifecycle_logs(cfg.logger.log_level), run_session(
        cfg, run_id, algorithm="grpo", intent=intent, recompute=recompute, log=log,
        configure=lambda c: ensure_warm_start(c, run_id, log),  # warm_start.sft_steps: SFT first (flows.algorithms.warm_start)
    ) as session:
        cfg, layout, opts = session.cfg, session.layout, session.storage_options
        if session.start.deletes:  # checked by the resume entry (flows.run.start), with the damaged data
            log.info("recompute %s: deleted %s", recompute, apply_recompute(layout, specs, opts, deletes=session.start.deletes))
        with session.running(max_steps=cfg.grpo.max_num_steps):
            log.info("%s run %s at %s (config hash %s)", "resuming" if session.resuming else "starting", run_id,
                     layout.run_uri, session.config_hash)
            rt = session.start_runtime()
            info = run_grpo_steps(
                session.context(), chash=session.config_hash, policy_fresh=not rt.policy_attached,
                refit_generation=session.start.refit_generation(workers_attached=rt.generation_attached),  # flows.run.start
                fence=session.fence, optimizer_reset=session.start.optimizer_reset, history=session.history,
            )
    rows = read_metrics(layout.metrics_uri, opts)
    from nrl_tasks.stages.checkpoint import list_checkpoints

    return {
        "run_id": run_id,
        "run_uri": layout.run_uri,
        "last_step": cfg.grpo.max_num_steps,
        "metrics_uri": layout.metrics_uri,
        "checkpoints": [u for _, u in list_checkpoints(layout.checkpoints_uri, opts)],
        "final_metrics": rows[-1] if rows else None,
        **info,
    }
