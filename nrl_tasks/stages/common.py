"""What every stage shares: idempotent persisted outputs, small manifests, task defaults.

A stage's output is one Arrow dataset at ``<run>/steps/step_NNNNNN/<stage>/``, written by
:func:`storage.save_batch` with metadata (``run_id``, ``step``, ``stage``,
``weights_version``, ``seconds`` and stage-specific figures). :func:`committed` returns the
manifest dict of an already committed output, which is how a stage is idempotent on
``(run_id, step, stage)`` across flow runs: Prefect's own caching is off (its keys include the
flow-run id and its results are pickles).

Stages are :class:`StageTask` objects (:func:`stage_task`): Prefect tasks whose config argument
reaches the function as it was passed instead of being walked field by field (Prefect
visits every argument to find futures, twice per call; a ``MasterConfig`` has a few hundred
nodes), and whose ``with_options`` variants are built once per set of options (Prefect
re-reads the function's source to build one).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any, Iterator

import pydantic
from prefect import Task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote

__all__ = [
    "TASK_DEFAULTS",
    "StageTask",
    "StageTimer",
    "committed",
    "manifest_dict",
    "save_output",
    "stage_meta",
    "stage_task",
]

#: Options shared by every stage task: no Prefect result caching/persistence (resume relies on
#: committed Arrow outputs), URIs in, small dicts out.
TASK_DEFAULTS: dict[str, Any] = {"cache_policy": NO_CACHE, "persist_result": False}


def _opaque(value: Any) -> Any:
    """Pydantic models (the run config) go to the task as they are, not walked by Prefect."""
    return quote(value) if isinstance(value, pydantic.BaseModel) else value


def _freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    hash(value)  # TypeError: not cacheable
    return value


class StageTask(Task):
    """A Prefect task for a pipeline stage (see the module docstring).

    Calls behave like ``Task.__call__``; pydantic-model arguments are passed wrapped in
    Prefect's ``quote`` (the function receives the model itself). ``with_options`` returns a
    ``StageTask`` and the same object for the same options (tasks are not mutated).
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*map(_opaque, args), **{k: _opaque(v) for k, v in kwargs.items()})

    def with_options(self, **options: Any) -> StageTask:  # type: ignore[override]
        try:
            key: Any = _freeze(options)
        except TypeError:
            key = None
        variants = self.__dict__.setdefault("_stage_variants", {})
        if key is not None and key in variants:
            return variants[key]
        new = super().with_options(**options)
        new.__class__ = type(self)
        if key is not None:
            variants[key] = new
        return new


def stage_task(**options: Any) -> Any:
    """``@stage_task(name=..., **TASK_DEFAULTS)``: like ``@prefect.task(...)``, making a :class:`StageTask`."""

    def wrap(fn: Any) -> StageTask:
        return StageTask(fn=fn, **options)

    return wrap


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def stage_meta(manifest: Any) -> dict[str, Any]:
    """The user metadata (``**meta`` of ``save_batch``) stored in a manifest."""
    for key in ("meta", "metadata", "user_meta"):
        value = _get(manifest, key)
        if isinstance(value, Mapping):
            return dict(value)
    if isinstance(manifest, Mapping):
        return dict(manifest)
    return {}


def manifest_dict(manifest: Any, uri: str) -> dict[str, Any]:
    """Small JSON-able summary of a committed dataset: ``uri, rows, step, stage, weights_version,
    checksum`` plus the stage metadata (figures such as ``seconds``)."""
    meta = stage_meta(manifest)
    out = {k: v for k, v in meta.items() if isinstance(v, (int, float, str, bool)) or v is None}
    for key in ("rows", "num_rows"):
        rows = _get(manifest, key)
        if rows is not None:
            out["rows"] = int(rows)
            break
    checksum = _get(manifest, "checksum")
    if checksum is None:
        shards = _get(manifest, "shards")
        if shards:
            checksum = ",".join(str(_get(s, "sha256", _get(s, "checksum", ""))) for s in shards)
    out.update(
        uri=uri,
        step=meta.get("step"),
        stage=meta.get("stage"),
        weights_version=meta.get("weights_version"),
        checksum=checksum,
    )
    return out


def committed(uri: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The manifest dict of the committed dataset at ``uri``, or ``None`` if there is none."""
    import storage

    if not storage.is_committed(uri, **_opts(storage_options)):
        return None
    return manifest_dict(storage.read_manifest(uri, **_opts(storage_options)), uri)


def _opts(storage_options: dict[str, Any] | None) -> dict[str, Any]:
    return {"storage_options": storage_options} if storage_options else {}


def save_output(
    batch: Any,
    uri: str,
    *,
    run_id: str,
    step: int,
    stage: str,
    weights_version: int | None,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    fsync: bool = True,
    **meta: Any,
) -> dict[str, Any]:
    """Persist a stage output and return its manifest dict (``fsync``: the run's ``storage.fsync``)."""
    import storage

    clean = {k: _jsonable(v) for k, v in meta.items()}
    manifest = storage.save_batch(
        batch,
        uri,
        overwrite=overwrite,
        fsync=fsync,
        **_opts(storage_options),
        run_id=run_id,
        step=int(step),
        stage=stage,
        weights_version=None if weights_version is None else int(weights_version),
        **clean,
    )
    return manifest_dict(manifest, uri)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


class StageTimer:
    """Wall-clock seconds of named phases of a stage (``timer.seconds["total"]``)."""

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
