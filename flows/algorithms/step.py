"""One step of a run, for every algorithm: its recipe's stages, then the one "finish the step" path.

::

    inputs = recipe.inputs(ctx, v)              # GRPO: prompts, generate, score (score submitted: runs beside logprob)
    datasets = recipe.update(ctx, inputs)       # GRPO: logprob, advantages, train; DPO: reference, train; SFT: train
    # finish_step: the same for every algorithm, at age 0 and in async GRPO alike
    checkpoint(ctx, trained)                    # when due (submitted: written while the refit runs)
    refitted = refit(ctx, trained, step)        # generation workers to version step (recipes that have them)
    validate(ctx, refitted)                     # when due (the recipe's validation)

Each stage is a Prefect task that receives the :class:`~nrl_tasks.stages.refs.DatasetRef` objects
the stages before it returned, so Prefect records the edges of this graph (task inputs) and the UI
draws it. Steps run grouped in subflows of the run's flow run (``logger.steps_per_subflow``,
:func:`steps_per_subflow`): by default a flow run's steps in at most :data:`SUBFLOWS_PER_FLOW_RUN`
subflows ``<run_id>-steps-0001-0010`` (the flow ``<kind>-steps``: the step bodies one after
another), so the UI's runs list shows runs, not steps, at any run length; with one step a subflow,
each step is its own subflow ``<run_id>-step-0007`` (the flow ``<kind>-step``). A subflow run again
after a fault gets ``-retry1``; every one is tagged ``run:<run_id>``; task runs are named after the
stage, run and step (``train-<run_id>-step7``). Subflows run without a Prefect heartbeat thread of
their own (:func:`without_subflow_heartbeats`). Every stage is idempotent
(:mod:`nrl_tasks.stages.runner`): running a step again recomputes only what is not committed. The
flow then writes the step's ``metrics.jsonl`` line, console line and artifacts (:func:`publish_step`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prefect import Flow, flow, get_run_logger
from prefect.runtime import flow_run
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.utilities.annotations import quote

from flows.algorithms.lanes import beside
from flows.config import MasterConfig
from flows.observe.artifacts import BackgroundPublisher, RunArtifacts, SummaryHandle, metrics_table
from flows.observe.flow_run_meta import add_flow_run_tags, run_tag
from flows.observe.metrics import upsert_metrics
from flows.observe.summary import metrics_window, summary_markdown
from flows.observe.trackers import TrackerSet
from flows.run.recipe import Recipe
from nrl_tasks.stages.checkpoint import checkpoint, list_checkpoints
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.refit import refit as refit_task
from nrl_tasks.stages.refs import StepRefs

__all__ = [
    "SUBFLOWS_PER_FLOW_RUN", "StepPlan", "StepSegment", "finish_step", "flow_label", "publish_step", "publish_summary", "run_step_body",
    "step_flows", "step_plan", "steps_per_subflow", "tag_flow_run", "without_subflow_heartbeats",
]

#: ``logger.steps_per_subflow`` unset: a flow run's steps in at most this many subflows
SUBFLOWS_PER_FLOW_RUN = 4


@dataclass(frozen=True)
class StepPlan:
    """What a step does besides its data stages (a small, JSON-able flow parameter)."""

    max_steps: int
    config_hash: str
    checkpoint: bool = False
    validate: bool = False
    #: write the step's metrics line (False: a resumed step whose line exists)
    write_line: bool = True
    attempt: int = 1


def step_plan(cfg: MasterConfig, recipe: Recipe, step: int, *, chash: str, write_line: bool = True) -> StepPlan:
    """What step ``step`` of a run of ``recipe`` does besides its data stages: a checkpoint every
    ``checkpointing.save_period`` steps and at the last, validation when the recipe says; with an
    early stop (:meth:`~flows.run.recipe.Recipe.stop_rule`) a validated step saves a checkpoint too
    (the run may end there)."""
    last = recipe.budget(cfg)
    ck = cfg.checkpointing
    validate = recipe.validation_due(cfg, step)
    may_stop = validate and recipe.stop_rule(cfg) is not None
    return StepPlan(
        max_steps=last, config_hash=chash,
        checkpoint=bool(ck.enabled and (step % ck.save_period == 0 or step == last or may_stop)),
        validate=validate, write_line=write_line,
    )


# ----------------------------------------------------------------------------------------------
# the step


def run_step_body(recipe: Recipe, ctx: StepContext, plan: StepPlan) -> StepRefs:
    """Step ``ctx.step`` at age 0: the recipe's stages on the weights of the step before, then
    :func:`finish_step` (the refit when the recipe has generation workers)."""
    inputs = recipe.inputs(ctx, ctx.step - 1, overlap=True)
    return finish_step(recipe, ctx, recipe.update(ctx, inputs), plan, refit=recipe.actors.generation)


def finish_step(
    recipe: Recipe, ctx: StepContext, datasets: Mapping[str, Any], plan: StepPlan, *, refit: bool,
    before_refit: Callable[[], None] | None = None,
) -> StepRefs:
    """The one end of every step, sync or async: the checkpoint when due, written while the
    generation workers are refitted to the trained version (``refit``; ``before_refit`` first:
    async GRPO waits there for the generations still running on older weights), then the
    recipe's validation when due, on the refitted workers."""
    c = quote(ctx)
    trained = datasets["train"]
    ck: Any = None
    refitted = None
    if refit:
        ck = checkpoint.submit(c, trained, plan.config_hash) if plan.checkpoint else None

        def send() -> Any:
            if before_refit is not None:
                before_refit()
            return refit_task(c, trained, trained.weights_version)

        refitted, ck = beside(ck, send)  # the checkpoint is written meanwhile
    elif plan.checkpoint:
        ck = checkpoint(c, trained, plan.config_hash)
    val = recipe.validate(ctx, refitted) if plan.validate else None
    fid = str(flow_run.id) if flow_run.id and (flow_run.name or "").startswith(f"{ctx.run_id}-step") else None
    return StepRefs(step=ctx.step, datasets=dict(datasets), refit=refitted, checkpoint=ck, val=val, flow_run_id=fid)


def steps_per_subflow(configured: int | None, max_steps: int) -> int:
    """Steps a subflow runs: ``logger.steps_per_subflow``, or by default enough that a flow run of
    ``max_steps`` steps has at most :data:`SUBFLOWS_PER_FLOW_RUN` subflows.

    >>> steps_per_subflow(None, 3), steps_per_subflow(None, 40), steps_per_subflow(None, 1000), steps_per_subflow(1, 1000)
    (1, 10, 250, 1)
    """
    return configured or max(1, math.ceil(max_steps / SUBFLOWS_PER_FLOW_RUN))


@dataclass(frozen=True)
class StepSegment:
    """Steps ``first``..``last`` of a run, run in one subflow (``attempt`` > 1: again, after a fault)."""

    run_id: str
    first: int
    last: int
    attempt: int = 1

    @property
    def steps(self) -> range:
        return range(self.first, self.last + 1)

    @property
    def name(self) -> str:
        """``<run_id>-steps-0001-0010``, ``-retry1`` when run again.

        >>> StepSegment("r", 6, 10, attempt=2).name
        'r-steps-0006-0010-retry1'
        """
        name = f"{self.run_id}-steps-{self.first:04d}-{self.last:04d}"
        return name if self.attempt <= 1 else f"{name}-retry{self.attempt - 1}"


def _step_run_name() -> str:
    params = flow_run.parameters or {}
    plan = params.get("plan") or {}
    attempt = plan.get("attempt", 1) if isinstance(plan, dict) else getattr(plan, "attempt", 1)
    ctx = params.get("ctx")
    name = f"{getattr(ctx, 'run_id', None) or 'run'}-step-{int(getattr(ctx, 'step', 0)):04d}"
    return name if int(attempt) <= 1 else f"{name}-retry{int(attempt) - 1}"


def _segment_run_name() -> str:
    segment = (flow_run.parameters or {}).get("segment")
    return segment.name if isinstance(segment, StepSegment) else "steps"


def flow_label(kind: str) -> str:
    """A kind as a Prefect flow-name prefix (a plug-in's ``module:Attr`` -> ``attr``).

    >>> flow_label("grpo"), flow_label("tests.algorithms.reinforce:REINFORCE")
    ('grpo', 'reinforce')
    """
    return kind.rpartition(":")[2].rpartition(".")[2].lower()


#: kind -> its step flow and steps flow (a cache: made once per process)
_STEP_FLOWS: dict[str, tuple[Flow, Flow]] = {}


def step_flows(recipe: Recipe) -> tuple[Flow, Flow]:
    """The Prefect flows ``<kind>-step`` (one step, :func:`run_step_body`) and ``<kind>-steps``
    (a segment of steps: ``run_one(step)`` runs a step's body in that flow run and publishes it)
    of ``recipe``'s runs."""
    if recipe.kind not in _STEP_FLOWS:
        label = flow_label(recipe.kind)

        def one_step(ctx: StepContext, plan: StepPlan) -> StepRefs:
            """One step of the run (see :mod:`flows.algorithms.step`)."""
            return run_step_body(recipe, ctx, plan)

        def steps(segment: StepSegment, run_one: Callable[[int], None]) -> None:
            """Steps ``segment.first``..``segment.last``, one after another."""
            for s in segment.steps:
                run_one(s)

        opts: dict[str, Any] = {"validate_parameters": False, "persist_result": False, "result_serializer": "json"}
        _STEP_FLOWS[recipe.kind] = (
            flow(name=f"{label}-step", flow_run_name=_step_run_name, **opts)(one_step),
            flow(name=f"{label}-steps", flow_run_name=_segment_run_name, **opts)(steps),
        )
    return _STEP_FLOWS[recipe.kind]


@contextmanager
def without_subflow_heartbeats() -> Iterator[None]:
    """Flow runs started inside (the step subflows) run without their own heartbeat thread; the
    run's flow run, already running, keeps its heartbeats (its thread read the setting at start).

    Prefect 3.9 gives every flow run a heartbeat thread that sleeps in one-second slices and is
    joined when the run ends, so each step subflow waited ~0.9 s for that thread (measured: a
    subflow of two tasks took 1.09 s, 0.14 s without it, on SQLite and PostgreSQL servers alike).
    A step subflow lives in the run's process, so the run's own heartbeats already tell whether
    it is alive."""
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def tag_flow_run(flow_run_id: str | None, run_id: str) -> None:
    """Tag a flow run (the run's, or a step's subflow) ``run:<run_id>`` after it started, keeping
    its other tags (:mod:`flows.observe.flow_run_meta`).

    Task runs carry no tags: on Prefect 3.9 every tagged task run acquires tag concurrency slots
    with a lease, a write on the server that waits behind the task-run recorder on SQLite (seconds
    per task under load); the run id and stage are in every task run's name instead."""
    add_flow_run_tags(flow_run_id, [run_tag(run_id)])


# ----------------------------------------------------------------------------------------------
# publishing


def publish_summary(ctx: StepContext, recipe: Recipe, rows: list[dict[str, Any]], max_steps: int,
                     links: dict[str, str] | None, handle: SummaryHandle) -> None:
    """Build and publish the run summary (in the publisher's thread: it lists the checkpoints);
    ``handle``: the flow run's summary, updated in place, with the run's history."""
    run = ctx.run
    ck = run.cfg.checkpointing
    md = summary_markdown(run.run_id, rows, max_steps, checkpoints=list_checkpoints(run.layout.checkpoints_uri, run.storage_options),
                          metric_name=ck.metric_name, higher_is_better=ck.higher_is_better, links=links, history=handle.history,
                          fields=recipe.summary)
    handle.publish(md)


def publish_step(
    ctx: StepContext,
    refs: StepRefs,
    plan: StepPlan,
    recipe: Recipe,
    *,
    wall_seconds: float | None,
    publisher: BackgroundPublisher | None = None,
    artifacts: RunArtifacts | None = None,
    extra: dict[str, Any] | None = None,
    trackers: TrackerSet | None = None,
    log: Any = None,
) -> dict[str, Any] | None:
    """The step's ``metrics.jsonl`` line (the recipe's; unless ``plan.write_line`` is off;
    ``extra`` figures added to it), console line, artifacts and tracker curves
    (:mod:`flows.observe.trackers`), the last two published in the background by ``publisher``
    into ``artifacts`` (the flow run's, updated in place; none without them). The step line goes
    to the current flow run's log (the step's subflow) and to ``log``, the logger of the run's
    flow run, when that is another."""
    run, cfg = ctx.run, ctx.cfg
    row = None
    if plan.write_line:
        row = recipe.metrics_line(ctx, refs, wall_seconds)
        row.update(extra or {})
        rows = upsert_metrics(run.layout.metrics_uri, row, run.storage_options)
        if trackers is not None and publisher is not None:
            publisher.submit(trackers.sync, rows)
        if cfg.logger.artifacts and publisher is not None and artifacts is not None:
            links = trackers.links() if trackers is not None else None
            publisher.submit(publish_summary, ctx, recipe, rows, plan.max_steps, links, artifacts.summary)
            if plan.checkpoint or ctx.step == plan.max_steps:  # bounded: not every step
                publisher.submit(artifacts.metrics.publish, metrics_table(metrics_window(rows)))
                for kind, markdown in recipe.publish_extra(ctx, refs):  # e.g. GRPO's best and worst rollouts
                    publisher.submit(artifacts.keyed(kind, kind.replace("_", " ")).publish, markdown)
        line = recipe.console_line(run.run_id, row, plan.max_steps)
        here = get_run_logger()  # the step's subflow, when it runs in one: its page shows its steps' lines
        here.info(line)
        if log is not None and getattr(log, "extra", None) != getattr(here, "extra", None):
            log.info(line)  # and the run's own flow run
        if cfg.logger.console:
            print(line, flush=True)
    if cfg.logger.artifacts and publisher is not None and artifacts is not None:
        publisher.submit(artifacts.progress.update, ctx.step, plan.max_steps)
    return row
