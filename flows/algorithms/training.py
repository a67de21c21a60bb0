"""The body of every algorithm's run flow, written once: a recipe (:class:`flows.run.recipe.Recipe`)
and the user's intent in, a finished run out.

::

    cfg = resolve the config (a new run's file + overrides; a resume's saved config.yaml)
    with run_session(cfg, run_id, recipe=recipe, intent) as session:   # lease, config hash, plan_start
        delete what the start deletes (--recompute items, damaged data made again)
        records = recipe.prepare(...)                                    # the run's data snapshots, before Ray
        with session.running(max_steps=recipe.budget(cfg)):              # status running ... completed
            run = session.context() on session.start_runtime(records)  # the recipe's actors
            run_steps(recipe, run, ...)                                  # recover, then the step driver

:func:`run_steps`: recovery (:func:`flows.run.recovery.recover`: restore and replay what a resume
or a killed predecessor left), validation of the initial weights when the recipe asks, then the
step driver (:class:`flows.algorithms.driver.StepDriver`) with the metrics line, the summary and
artifacts, the trackers (TensorBoard, MLflow, W&B) and retention after every step. Nothing here
names an algorithm; each algorithm's module defines its Prefect flow as a thin call of
:func:`train_run` with its recipe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Cancelled
from prefect.exceptions import MissingContextError
from prefect.runtime import flow_run

from flows.algorithms.driver import StepDriver
from flows.algorithms.step import (
    StepPlan,
    flow_label,
    publish_step,
    publish_summary,
    step_plan,
    tag_flow_run,
    without_subflow_heartbeats,
)
from flows.config import ConfigError, MasterConfig, changed_keys, config_to_yaml
from flows.observe.artifacts import BackgroundPublisher, RunArtifacts
from flows.observe.metrics import read_metrics
from flows.observe.quiet_logs import quiet_lifecycle_logs
from flows.observe.trackers import open_trackers, publish_tracker_links
from flows.run.hints import deployment_default, from_deployment
from flows.run.preflight import check_plugins
from flows.run.recipe import Recipe
from flows.run.recompute import apply_recompute, parse_recompute
from flows.run.recovery import RetryBudget, recover, run_step
from flows.run.resolve import new_run_id, resolve_config
from flows.run.retention import RetentionPolicy, apply_retention
from flows.run.runtime import load_tokenizer
from flows.run.session import RunIntent, run_session, tag_this_flow_run
from nrl_tasks.run_layout import validate_run_id
from nrl_tasks.stages.checkpoint import list_checkpoints
from nrl_tasks.stages.context import RunContext
from storage import delete_batch
from storage.lease import LeaseHeldError

__all__ = ["flow_run_namer", "recipe_flow", "resume_config", "run_steps", "train_run"]

#: how long a subflow start waits for the run's own background API writes (see StepDriver)
SUBFLOW_START_WAIT_S = 2.0


def flow_run_namer(kind: str) -> Callable[[], str]:
    """The first name of a flow run of ``kind`` (the session renames it once the run is known:
    ``<run_id>``, ``<run_id>-resume-2``, ...)."""

    def name() -> str:
        params = flow_run.parameters or {}
        rid = params.get("run_id") or new_run_id(kind)
        return f"{rid}-resume" if params.get("resume") else str(rid)

    return name


def resume_config(
    recipe: Recipe, config: Any, overrides: list[str] | None, storage: str | None, run_id: str, log: Any,
    *, saved_form: Callable[[MasterConfig], MasterConfig] | None = None,
) -> MasterConfig:
    """The config a resume runs: the run's saved ``config.yaml`` with ``overrides`` applied.

    The deployment's own default ``config`` (sent with every run of it, chosen or not) is not
    used. Another ``config`` passed as well is ignored with a warning when it resolves to the same
    result-affecting settings (``saved_form``: how a new run's config
    is saved, e.g. GRPO's on its warm-start weights); one that would change them is refused
    (``ConfigError`` naming the keys): a run keeps the config it was created with."""
    saved = resolve_config(None, overrides, storage, run_id=run_id, recipe=recipe)
    if config is not None and config == deployment_default("config"):  # sent by the deployment, not chosen
        log.info("resume of run %s: the deployment's default config is not used; the run's saved config.yaml is "
                 "(with the overrides %s)", run_id, list(overrides or []))
        return saved
    if config is None:
        return saved
    given = resolve_config(config, overrides, storage or saved.storage.root)
    changed = changed_keys(saved, saved_form(given) if saved_form is not None else given)
    if changed:
        raise ConfigError(
            f"resume of run {run_id!r}: the config parameter changes the run's saved config in {', '.join(changed[:12])}"
            f"{' ...' if len(changed) > 12 else ''}; resume without it (the run's config.yaml is used, with the overrides)"
        )
    log.warning("resume of run %s: the config parameter is ignored; the run's saved config.yaml is used (with the "
                "overrides %s)", run_id, list(overrides or []))
    return saved


def run_steps(
    recipe: Recipe, run: RunContext, *, chash: str, refit_generation: bool, policy_fresh: bool = False,
    fence: Callable[[], None] | None = None, optimizer_reset: int | None = None, history: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Recover, then run the steps of a run on its schedule (see the module docstring).

    ``history``: the run's history (``status.json``), shown in the run summary. ``fence()`` runs
    before each step and raises when this flow may no longer write the run (its lease was taken
    over). ``optimizer_reset``: the checkpoint restored without optimizer state
    (``--fresh-optimizer``): the metrics line of the first step trained says ``optimizer_reset: true``.
    The last trained step of a resumed run runs once more (its stages are committed and skip; what
    it had not finished, checkpoint, refit, validation, metrics line, is done)."""
    cfg = run.cfg
    log = get_run_logger()
    layout, opts = run.layout, run.storage_options
    restored = recover(run, recipe, recipe.budget(cfg), force_refit=refit_generation, policy_fresh=policy_fresh, log=log,
                       fresh_optimizer_at=optimizer_reset)
    last = restored["plan"].target
    if restored["restored_from"] == "live" and last > 0 and getattr(run.actors, "policy_attached", False):
        log.info("attached to live policy actors at weights version %d", last)
    retention = RetentionPolicy.from_config(cfg)  # never deletes what a resume reads
    budget = RetryBudget.for_run(cfg, recipe)
    pruned: set[int] = set()  # steps retention found without batches (inspected once per run)
    artifacts = RunArtifacts(run.run_id, history, algorithm=recipe.kind.upper())  # one of each kind, updated in place
    publisher = BackgroundPublisher()
    have_lines = {int(r["step"]) for r in read_metrics(layout.metrics_uri, opts)}
    trackers = open_trackers(cfg, run.run_id, config_to_yaml(cfg))  # flows.observe.trackers: curves, resumed in place
    publisher.submit(trackers.sync, read_metrics(layout.metrics_uri, opts))  # what a crash kept from them
    publisher.submit(publish_tracker_links, trackers.links(), run.run_id)  # e.g. the MLflow run, as a link artifact
    tagged: set[str] = set()  # subflows tagged run:<id> (a segment's steps share one)

    def publish(ctx: Any, refs: Any, plan: StepPlan, **kw: Any) -> Any:
        if refs.flow_run_id and refs.flow_run_id not in tagged:
            tagged.add(refs.flow_run_id)
            publisher.submit(tag_flow_run, refs.flow_run_id, run.run_id)
        if optimizer_reset is not None and refs.step == last + 1:  # the first step trained with a fresh optimizer
            kw["extra"] = {**(kw.get("extra") or {}), "optimizer_reset": True}
        return publish_step(ctx, refs, plan, recipe, publisher=publisher, artifacts=artifacts, trackers=trackers, **kw)

    # async GRPO: a resume may need the checkpoint at or before version step - age (the steps
    # generated ahead on older weights): retention keeps what that resume reads
    age = recipe.schedule(cfg).lookahead
    driver = StepDriver(
        # a step trained by this flow writes its line (a killed run may have left one of a step it
        # had trained, whose train was lost); the last trained step's line only when missing
        run, recipe, lambda s: step_plan(cfg, recipe, s, chash=chash, write_line=s > last or s not in have_lines),
        budget=budget, fence=fence, publish=publish,
        # never waits longer than the ~2 s retry it saves (flows.algorithms.driver)
        before_subflow=lambda: publisher.flush(timeout_s=SUBFLOW_START_WAIT_S),
        after_step=lambda s: apply_retention(layout, retention, max(0, s - age), opts, pruned=pruned,
                                             prunable=recipe.graph.step_inputs),
    )
    try:
        if last == 0 and recipe.validation_due(cfg, 0):  # the initial weights' figures
            run_step(run, recipe, 0, lambda attempt: recipe.validate(run.step(0), None), budget, log=log)
        loop_t0 = time.perf_counter()
        with without_subflow_heartbeats():  # the step subflows (flows.algorithms.step): no ~0.9 s heartbeat join each
            walls = driver.run_from(last)
    finally:
        publisher.close()
        trackers.close()
    links = trackers.links()
    end = driver.stopped[0] if driver.stopped is not None else recipe.budget(cfg)  # the run's last step

    def publish_final(closed_history: list[dict[str, Any]]) -> None:
        """The summary once more when ``status.json`` says completed: this flow's entry closed."""
        if cfg.logger.artifacts:
            artifacts.summary.history = list(closed_history)
            publish_summary(run.step(end), recipe, read_metrics(layout.metrics_uri, opts), recipe.budget(cfg),
                            links, artifacts.summary)

    stopped = {"stopped_early": {"step": end, "why": driver.stopped[1]}} if driver.stopped is not None else {}
    return {"restored": {k: v for k, v in restored.items() if k != "plan"}, "first_step": last + 1, "publish_final": publish_final,
            "step_wall_s": [w for s, w in sorted(walls.items()) if s > last], "loop_s": time.perf_counter() - loop_t0,
            "last_step": end, **stopped}


def _logger() -> Any:
    """Prefect's run logger inside a flow run, this module's logger elsewhere (the flow's
    function called directly: ``grpo.fn(...)``)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def train_run(
    recipe: Recipe,
    *,
    config: Any = None,
    run_id: str | None = None,
    resume: bool = False,
    overrides: list[str] | None = None,
    storage: str | None = None,
    recompute: list[str] | None = None,
    take_over: bool = False,
    fresh_optimizer: bool = False,
    configure: Callable[[MasterConfig, str, Any], MasterConfig] | None = None,
    saved_form: Callable[[MasterConfig, str], MasterConfig] | None = None,
) -> dict[str, Any]:
    """A run of ``recipe`` from start (or resume) to its end (see the module docstring); what
    the algorithm's flow returns: ``{"run_id", "run_uri", "last_step", "metrics_uri",
    "checkpoints", "final_metrics", "restored", "first_step", ...}``.

    ``configure(cfg, run_id, log)``: the algorithm's own step on a config before the run is created
    or its hash checked, under the lease (GRPO's warm start, which trains an SFT run first);
    ``saved_form(cfg, run_id)``: the config it then saves, without that work (what a resume's
    ``config`` parameter is compared in)."""
    given = run_id
    run_id = validate_run_id(run_id) if run_id else new_run_id(recipe.kind.rpartition(":")[2].lower())
    tag_this_flow_run(run_id)  # before the config is read: a flow run refused for its config is tagged too
    log = _logger()
    fix = (lambda c: configure(c, run_id, log)) if configure is not None else None
    saved = (lambda c: saved_form(c, run_id)) if saved_form is not None else None
    if resume and given:
        cfg = resume_config(recipe, config, overrides, storage, run_id, log, saved_form=saved)
    else:
        cfg = resolve_config(config, overrides, storage, recipe=recipe)
    specs = parse_recompute(recompute, recipe.graph)
    if specs and not resume:
        raise ValueError("recompute needs resume=True")
    problems = recipe.check_config(cfg)
    if problems:
        raise ConfigError("; ".join(problems))
    check_plugins(cfg)  # before the lease, the run's directory and Ray (a deployment run skips the CLI's preflight)
    intent = RunIntent(resume=resume, take_over=take_over, fresh_optimizer=fresh_optimizer)
    with quiet_lifecycle_logs(cfg.logger.log_level), run_session(
        cfg, run_id, recipe=recipe, intent=intent, recompute=recompute, log=log, configure=fix, saved_form=saved,
    ) as session:
        cfg, layout, opts = session.cfg, session.layout, session.storage_options
        if session.start.deletes:  # checked by the resume entry (flows.run.start), with the damaged data
            log.info("recompute %s: deleted %s", recompute, apply_recompute(layout, specs, opts, deletes=session.start.deletes))
        for uri in session.start.rebuild:  # damaged, made again by the steps (the same bytes)
            delete_batch(uri, **({"storage_options": opts} if opts else {}))
            log.warning("deleted damaged %s: it is made again", uri)
        tokenizer = load_tokenizer(cfg)
        records = recipe.prepare(layout, cfg, tokenizer)  # a bad data file fails here, before Ray
        with session.running(max_steps=recipe.budget(cfg)):
            log.info("%s %s run %s at %s (config hash %s)", "resuming" if session.resuming else "starting", recipe.kind,
                     run_id, layout.run_uri, session.config_hash)
            rt = session.start_runtime(records, tokenizer)
            info = run_steps(
                recipe, session.context(), chash=session.config_hash, policy_fresh=not rt.policy_attached,
                refit_generation=session.start.refit_generation(workers_attached=rt.generation_attached),  # flows.run.start
                fence=session.fence, optimizer_reset=session.start.optimizer_reset, history=session.history,
            )
            session.on_completed.append(info.pop("publish_final"))
            session.finish(restored=info["restored"], last_step=info["last_step"],
                           **({"stopped_early": info["stopped_early"]} if "stopped_early" in info else {}))
    rows = read_metrics(layout.metrics_uri, opts)
    return {
        "run_id": run_id,
        "run_uri": layout.run_uri,
        "metrics_uri": layout.metrics_uri,
        "checkpoints": [u for _, u in list_checkpoints(layout.checkpoints_uri, opts)],
        "final_metrics": rows[-1] if rows else None,
        "final_line": recipe.console_line(run_id, rows[-1], recipe.budget(cfg)) if rows else None,
        **info,  # last_step: the budget, or the step an early stop ended the run at
    }


#: kind -> the Prefect flow of a recipe (a cache: made once per process)
_FLOWS: dict[str, Any] = {}

_FLOW_DOC = """{summary}

    The flow holds the run's lease (:mod:`flows.run.lease`) from before its first write to its
    end. Returns ``{{"run_id", "run_uri", "last_step", "metrics_uri", "checkpoints", "final_metrics",
    "restored", "first_step"}}`` (``restored``: where the weights came from and the steps replayed).

    Args:
        config: YAML config path (e.g. configs/{kind}_tiny.yaml), a dict or a MasterConfig. Ignored
            (with a warning) when resuming: the run keeps its saved config.yaml; refused if it
            would change the run's result-affecting settings.
        run_id: the run's id (default: a new one); with resume, the run to continue.
        resume: continue the run from its persisted batches and checkpoints (e.g. extend a
            finished run with overrides=["{section}.max_num_steps=70"]).
        overrides: dotted key=value overrides, e.g. ["{section}.max_num_steps=70", "policy.optimizer.kwargs.lr=1e-5"].
        storage: storage root holding the runs: a local path, file:// or s3://bucket/prefix.
        recompute: with resume, STAGE@STEP items to recompute (e.g. ["{stage}@3"]).
        take_over: take the run's lease from a holder that looks live but is gone (its machine died).
        fresh_optimizer: with resume, train on from a checkpoint saved without optimizer state
            (checkpointing.save_optimizer=false; refused otherwise), recorded as optimizer_reset.
    """


def refusal_state(exc: BaseException) -> Any:
    """A ``Cancelled`` state saying why the run was refused (its config, an existing run id,
    another writer), for a deployment's own flow run (the UI's Run, a schedule): it reads as
    refused, not as a red Failed with a traceback. None elsewhere: the CLI and a parent flow get
    the exception (exit 2; the pipeline's own handling)."""
    if not from_deployment() or flow_run.get_parent_flow_run_id():
        return None
    get_run_logger().error("refused: %s", exc)
    return Cancelled(message=f"refused: {exc}"[:2000])


def recipe_flow(
    recipe: Recipe, *, summary: str | None = None, configure: Callable[[MasterConfig, str, Any], MasterConfig] | None = None,
    saved_form: Callable[[MasterConfig, str], MasterConfig] | None = None,
) -> Any:
    """The Prefect flow of ``recipe``'s runs (:func:`train_run`), named after its kind
    (``grpo``, ``dpo``, ``sft``; a plug-in ``module:NAME`` -> ``name``): every algorithm module makes
    its flow with it (``grpo = recipe_flow(GRPO, ...)``, a deployment's entrypoint), and a recipe
    defined outside :mod:`flows.algorithms` runs as ``recipe_flow(self)(**params)``.
    ``summary``: the flow's first docstring line; ``configure`` / ``saved_form``: :func:`train_run`'s."""
    if recipe.kind not in _FLOWS:
        label = flow_label(recipe.kind)

        def run_recipe(config: str | dict | MasterConfig | None = None, run_id: str | None = None, resume: bool = False,
                       overrides: list[str] | None = None, storage: str | None = None, recompute: list[str] | None = None,
                       take_over: bool = False, fresh_optimizer: bool = False) -> Any:
            try:
                return train_run(recipe, config=config, run_id=run_id, resume=resume, overrides=overrides, storage=storage,
                                 recompute=recompute, take_over=take_over, fresh_optimizer=fresh_optimizer,
                                 configure=configure, saved_form=saved_form)
            except (ConfigError, LeaseHeldError) as exc:
                refused = refusal_state(exc)
                if refused is None:
                    raise
                return refused

        run_recipe.__name__ = run_recipe.__qualname__ = label
        run_recipe.__doc__ = _FLOW_DOC.format(summary=summary or f"Train with {label}.", kind=label, section=recipe.section,
                                              stage=recipe.graph.stages[-1].name)
        _FLOWS[recipe.kind] = flow(name=label, flow_run_name=flow_run_namer(label), validate_parameters=False,
                                   persist_result=False)(run_recipe)
    return _FLOWS[recipe.kind]
