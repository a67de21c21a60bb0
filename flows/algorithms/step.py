"""One GRPO step as a Prefect subflow: the data flow of the step, readable top to bottom.

::

    prompts = prompts(ctx)
    rollouts = generate(ctx, prompts, v)           # on the generation workers, weights version v = step - 1
    rewards = score(ctx, rollouts)                 # (submitted: runs while logprob runs)
    # (grpo.use_dynamic_sampling: generation batches until enough groups have reward variance,
    #  then the step's prompts, rollouts and rewards from them: :func:`flows.algorithms.lanes.sampled_stages`)
    logprobs = logprob(ctx, rollouts, v)           # policy + reference logprobs
    advantages = advantages(ctx, rollouts, rewards)
    trained = train(ctx, rollouts, logprobs, advantages)    # policy at version step
    checkpoint(ctx, trained)                                # when due (submitted: written while the refit runs)
    refitted = refit(ctx, trained, step)                    # generation workers to version step
    validate(ctx, refitted, step)                           # when due

The first three stages are the generation lane, ``logprob`` to ``checkpoint`` the policy lane,
each defined once in :mod:`flows.algorithms.lanes` (async GRPO and recovery run the same lanes).

Each stage is a Prefect task that receives the :class:`~nrl_tasks.stages.refs.DatasetRef` objects
the stages before it returned, so Prefect records the edges of this graph (task inputs) and the UI
draws it. Steps run grouped in subflows of the run's flow run (``logger.steps_per_subflow``,
:func:`steps_per_subflow`): by default a flow run's steps in at most :data:`SUBFLOWS_PER_FLOW_RUN`
subflows ``<run_id>-steps-0001-0010`` (:func:`grpo_steps`: the step bodies one after another), so
the UI's runs list shows runs, not steps, at any run length; with one step a subflow, each step
is its own subflow ``<run_id>-step-0007`` (:func:`grpo_step`). A subflow run again after a fault
gets ``-retry1``; every one is tagged ``run:<run_id>``; task runs are named after the stage, run
and step (``train-<run_id>-step7``). Subflows run without a Prefect heartbeat thread of their own
(:func:`without_subflow_heartbeats`). Every stage is idempotent (:mod:`nrl_tasks.stages.runner`): running a step again
recomputes only what is not committed. The flow then writes the step's ``metrics.jsonl`` line,
console line and artifacts (:func:`publish_step`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prefect import flow, get_run_logger
from prefect.utilities.annotations import quote

from flows.observe.artifacts import BackgroundPublisher, RunArtifacts, SummaryHandle, metrics_table, rollouts_markdown
from flows.observe.summary import metrics_window, summary_markdown
from flows.observe.flow_run_meta import add_flow_run_tags, run_tag
from flows.observe.trackers import TrackerSet
from flows.observe.metrics import build_step_metrics, format_console_line, upsert_metrics
from flows.algorithms.lanes import beside, data_stages, generation_lane, policy_lane, sampled_stages
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.evaluate import validate
from nrl_tasks.stages.refit import refit
from nrl_tasks.stages.refs import StepRefs

__all__ = [
    "SUBFLOWS_PER_FLOW_RUN", "StepPlan", "StepSegment", "data_stages", "grpo_step", "grpo_steps", "publish_step", "sampled_stages",
    "steps_per_subflow", "tag_flow_run", "without_subflow_heartbeats",
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


def _step_run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    plan = params.get("plan") or {}
    attempt = plan.get("attempt", 1) if isinstance(plan, dict) else getattr(plan, "attempt", 1)
    ctx = params.get("ctx")
    run_id = getattr(ctx, "run_id", None) or "grpo"
    step = getattr(ctx, "step", 0)
    name = f"{run_id}-step-{int(step):04d}"
    return name if int(attempt) <= 1 else f"{name}-retry{int(attempt) - 1}"


@flow(name="grpo-step", flow_run_name=_step_run_name, validate_parameters=False, persist_result=False, result_serializer="json")
def grpo_step(ctx: StepContext, plan: StepPlan) -> StepRefs:
    """Step ``ctx.step`` of the run (see the module docstring)."""
    c = quote(ctx)
    # score runs beside logprob, the checkpoint beside the refit (each pair reads the same inputs)
    datasets, ck = policy_lane(ctx, generation_lane(ctx, ctx.step - 1, overlap_score=True), plan, submit_checkpoint=True)
    trained = datasets["train"]
    refitted, ck = beside(ck, lambda: refit(c, trained, trained.weights_version))  # the checkpoint is written meanwhile
    val = validate(c, refitted, trained.weights_version) if plan.validate else None
    from prefect.runtime import flow_run

    fid = str(flow_run.id) if flow_run.id and flow_run.name.startswith(f"{ctx.run_id}-step") else None  # step or steps subflow
    return StepRefs(step=ctx.step, datasets=datasets, refit=refitted, checkpoint=ck, val=val, flow_run_id=fid)


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


def _segment_run_name() -> str:
    from prefect.runtime import flow_run

    segment = (flow_run.parameters or {}).get("segment")
    return segment.name if isinstance(segment, StepSegment) else "grpo-steps"


@flow(name="grpo-steps", flow_run_name=_segment_run_name, validate_parameters=False, persist_result=False, result_serializer="json")
def grpo_steps(segment: StepSegment, run_one: Callable[[int], None]) -> None:
    """Steps ``segment.first``..``segment.last``, one after another: ``run_one(step)`` runs a
    step's body (:func:`grpo_step`'s, in this flow run) and publishes it."""
    for step in segment.steps:
        run_one(step)


def _publish_summary(run: Any, rows: list[dict[str, Any]], max_steps: int, links: dict[str, str] | None,
                     handle: SummaryHandle) -> None:
    """Build and publish the run summary (in the publisher's thread: it lists the checkpoints);
    ``handle``: the flow run's summary, updated in place, with the run's history."""
    from nrl_tasks.stages.checkpoint import list_checkpoints

    ck = run.cfg.checkpointing
    md = summary_markdown(run.run_id, rows, max_steps, checkpoints=list_checkpoints(run.layout.checkpoints_uri, run.storage_options),
                          metric_name=ck.metric_name, higher_is_better=ck.higher_is_better, links=links, history=handle.history)
    handle.publish(md)


@contextmanager
def without_subflow_heartbeats() -> Iterator[None]:
    """Flow runs started inside (the step subflows) run without their own heartbeat thread; the
    run's flow run, already running, keeps its heartbeats (its thread read the setting at start).

    Prefect 3.9 gives every flow run a heartbeat thread that sleeps in one-second slices and is
    joined when the run ends, so each step subflow waited ~0.9 s for that thread (measured: a
    subflow of two tasks took 1.09 s, 0.14 s without it, on SQLite and PostgreSQL servers alike).
    A step subflow lives in the run's process, so the run's own heartbeats already tell whether
    it is alive."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def tag_flow_run(flow_run_id: str | None, run_id: str) -> None:
    """Tag a flow run (the run's, or a step's subflow) ``run:<run_id>`` after it started, keeping
    its other tags (:mod:`flows.observe.flow_run_meta`).

    Task runs carry no tags: on Prefect 3.9 every tagged task run acquires tag concurrency slots
    with a lease, a write on the server that waits behind the task-run recorder on SQLite (seconds
    per task under load); the run id and stage are in every task run's name instead."""
    add_flow_run_tags(flow_run_id, [run_tag(run_id)])


def publish_step(
    ctx: StepContext,
    refs: StepRefs,
    plan: StepPlan,
    *,
    wall_seconds: float | None,
    publisher: BackgroundPublisher | None = None,
    artifacts: RunArtifacts | None = None,
    extra: dict[str, Any] | None = None,
    trackers: TrackerSet | None = None,
    log: Any = None,
) -> dict[str, Any] | None:
    """The step's ``metrics.jsonl`` line (unless ``plan.write_line`` is off; ``extra`` figures
    added to it), console line, artifacts and tracker curves (:mod:`flows.observe.trackers`), the last two
    published in the background by ``publisher`` into ``artifacts`` (the flow run's, updated in
    place; none without them). ``log``: the logger of the run's flow run (its
    log gets the step line also when the step ran in a subflow; default: the current run's)."""
    import storage

    run, cfg = ctx.run, ctx.cfg
    row = None
    if plan.write_line:
        rw = storage.load_batch(ctx.uri("rewards"), columns=["rewards", "reward_valid"], **ctx.storage_kw)
        row = build_step_metrics(
            ctx.step, {k: v.summary() for k, v in refs.datasets.items() if v is not None},
            refit=refs.refit.summary() if refs.refit else None,
            val=refs.val.summary() if refs.val else None,
            checkpoint=refs.checkpoint.summary() if refs.checkpoint else None,
            wall_seconds=wall_seconds, rewards=(rw["rewards"], rw["reward_valid"]),
        )
        if refs.datasets.get("logprobs", True) is None:
            row["logprob_skipped"] = True  # nothing reads them (loss_fn.force_on_policy_ratio, no KL)
        row.update(extra or {})
        rows = upsert_metrics(run.layout.metrics_uri, row, run.storage_options)
        if trackers is not None and publisher is not None:
            publisher.submit(trackers.sync, rows)
        if cfg.logger.artifacts and publisher is not None and artifacts is not None:
            links = trackers.links() if trackers is not None else None
            publisher.submit(_publish_summary, run, rows, plan.max_steps, links, artifacts.summary)
            if plan.checkpoint or ctx.step == plan.max_steps:  # bounded: not every step
                publisher.submit(artifacts.metrics.publish, metrics_table(metrics_window(rows)))
                n = cfg.logger.num_rollouts_to_show
                if n > 0:
                    convo = cfg.env.environment is not None  # multi-turn: show whole episodes too
                    cols = ["prompt", "response", "answer", *(["message_log"] if convo else [])]
                    r = storage.load_batch(ctx.uri("rollouts"), columns=cols, **ctx.storage_kw)
                    md = rollouts_markdown(run.run_id, ctx.step, r["prompt"], r["response"], r["answer"], rw["rewards"].tolist(), n=n,
                                           conversations=r["message_log"] if convo else None)
                    publisher.submit(artifacts.rollouts.publish, md)
        line = format_console_line(run.run_id, row, plan.max_steps)
        (log or get_run_logger()).info(line)
        if cfg.logger.console:
            print(line, flush=True)
    if cfg.logger.artifacts and publisher is not None and artifacts is not None:
        publisher.submit(artifacts.progress.update, ctx.step, plan.max_steps)
    return row
