"""The one stage skeleton: skip if committed, load the inputs, compute, save, count the attempt.

Every data stage of a step is :func:`run_stage` around its pure compute part::

    def score(ctx: StepContext, rollouts: DatasetRef) -> DatasetRef:
        return run_stage(ctx, "score", _score, inputs={"rollouts": rollouts})

1. **Skip if committed.** The output ``steps/step_N/<output>`` is already committed (by this or an
   earlier flow run): its reference is returned, nothing is read or computed. This is what makes
   a stage idempotent on ``(run_id, step, stage)`` across flow runs (Prefect's own caching is off:
   its keys include the flow-run id and its results are pickles).
2. **Load** the input datasets from the references the stage was given (only those: a reference
   of another step or dataset is refused).
3. **Compute** (``compute(inputs, timer) -> (batch, figures)``), timed by a :class:`StageTimer`.
4. **Save** the batch with :func:`storage.save_batch` (shards, then the manifest: the commit) with
   the figures in its metadata; return a :class:`~nrl_tasks.stages.refs.DatasetRef`.

Around these, the run context counts the attempt (``<stage>_attempts``), records a failure
(``RunContext.last_failure``: what the flow's recovery re-plans for) and tells its observers the
stage started, computed and committed.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any, Iterator

from prefect.cache_policies import NO_CACHE

import storage
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.refs import DatasetRef

logger = logging.getLogger(__name__)

__all__ = ["TASK_DEFAULTS", "StageTimer", "committed_ref", "run_stage", "save_output", "stage_failures"]

#: Options of every stage task: no Prefect result caching/persistence (resume relies on committed
#: Arrow outputs), references in and out.
TASK_DEFAULTS: dict[str, Any] = {"cache_policy": NO_CACHE, "persist_result": False}

Compute = Callable[[Mapping[str, Any], "StageTimer"], "tuple[Any, dict[str, Any]]"]


class StageTimer:
    """Wall-clock seconds of named phases of a stage (``timer.seconds["generate"]``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t0 = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

    def total(self) -> float:
        return time.perf_counter() - self._t0


def committed_ref(uri: str, storage_options: dict[str, Any] | None = None, *, attempts: int = 0) -> DatasetRef | None:
    """The reference of the committed dataset at ``uri``, or ``None`` if there is none."""

    kw = {"storage_options": storage_options} if storage_options else {}
    if not storage.is_committed(uri, **kw):
        return None
    return DatasetRef.from_manifest(storage.read_manifest(uri, **kw), uri, attempts=attempts)


def _jsonable(value: Any, key: str = "") -> Any:
    """A manifest meta value: tensors/arrays of one element as numbers, a non-finite float as
    ``None`` (JSON has no NaN/inf; the train stage fails on a non-finite loss before it gets here,
    other figures are reported, not fatal), anything else JSON can hold as is, else its ``str``."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        logger.warning("manifest meta %r is %r: recorded as null", key, value)
        return None
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


def save_output(
    batch: Any,
    uri: str,
    *,
    run_id: str,
    step: int,
    stage: str,
    weights_version: int | None,
    storage_options: dict[str, Any] | None = None,
    fsync: bool = True,
    attempts: int = 0,
    **meta: Any,
) -> DatasetRef:
    """Persist a stage output (``fsync``: the run's ``storage.fsync``) and return its reference."""

    kw = {"storage_options": storage_options} if storage_options else {}
    manifest = storage.save_batch(
        batch,
        uri,
        fsync=fsync,
        **kw,
        run_id=run_id,
        step=int(step),
        stage=stage,
        weights_version=None if weights_version is None else int(weights_version),
        **{k: _jsonable(v, k) for k, v in meta.items()},
    )
    return DatasetRef.from_manifest(manifest, uri, attempts=attempts)


def _load_inputs(ctx: StepContext, name: str, inputs: Mapping[str, DatasetRef]) -> dict[str, Any]:
    try:
        allowed = set(ctx.run.graph.spec(name).all_inputs)
    except KeyError:  # a stage outside the step graph (validate): no declared inputs to check
        allowed = set()
    out = {}
    for dataset, ref in inputs.items():
        if not isinstance(ref, DatasetRef):
            raise TypeError(f"stage {name!r} step {ctx.step}: input {dataset!r} is {type(ref).__name__}, not a DatasetRef")
        if ref.step != ctx.step or ref.stage != dataset or (allowed and dataset not in allowed):
            raise ValueError(
                f"stage {name!r} of step {ctx.step} was handed {ref.stage!r} of step {ref.step} as its {dataset!r} input"
            )
        out[dataset] = storage.load_batch(ref.uri, **ctx.storage_kw)
    return out


def run_stage(
    ctx: StepContext,
    name: str,
    compute: Compute,
    *,
    inputs: Mapping[str, DatasetRef] | None = None,
    output: str | None = None,
    weights_version: int | None = None,
) -> DatasetRef:
    """Run data stage ``name`` of ``ctx.step`` (see the module docstring); its output reference."""
    run = ctx.run
    output = output or run.graph.spec(name).output  # validate passes its own ("val")
    uri = ctx.uri(output)
    key = ctx.attempt_key(name)
    done = committed_ref(uri, run.storage_options, attempts=run.attempts.get((ctx.step, key), 0))
    if done is not None:
        return done
    attempt = run.count_attempt(ctx.step, key)
    try:
        ctx.emit(name, "start")
        timer = StageTimer()
        with timer.phase("load"):
            batches = _load_inputs(ctx, name, inputs or {})
        batch, figures = compute(batches, timer)
        ctx.emit(name, "computed")
        note = {"recovered": False, **run.recovery_notes.get(name, {})}
        run.check_fence()  # a fenced writer (its lease taken over) commits nothing more
        ref = save_output(
            batch, uri, run_id=run.run_id, step=ctx.step, stage=output, weights_version=weights_version,
            storage_options=run.storage_options, fsync=run.fsync, attempts=attempt,
            seconds=timer.total(), **note, **figures,
        )
        run.recovery_notes.pop(name, None)
        ctx.emit(name, "committed")
    except BaseException:
        run.last_failure = (ctx.step, name)
        raise
    return ref


@contextmanager
def stage_failures(ctx: StepContext, name: str) -> Iterator[int]:
    """For steps actions without a dataset (refit, checkpoint): count the attempt, record a failure."""
    attempt = ctx.run.count_attempt(ctx.step, name)
    try:
        yield attempt
    except BaseException:
        ctx.run.last_failure = (ctx.step, name)
        raise
