"""Typed records passed between the stage tasks of a step.

A stage returns a :class:`DatasetRef` to its committed output, and the next stage receives the
references it reads as arguments: the data flow is explicit in the code and Prefect records it
(an argument that is the very object an upstream task returned becomes an upstream edge of the
task run). A reference is small (a URI and a few figures); the batch itself stays on storage.

>>> ref = DatasetRef(uri="runs/r/steps/step_000001/rollouts", stage="rollouts", step=1, rows=8,
...                  weights_version=0, checksum="ab", meta={"seconds": 0.5})
>>> ref.get("seconds"), ref.get("rows"), ref.get("missing", 3)
(0.5, 8, 3)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["ActionResult", "DatasetRef", "StepRefs"]

_SCALARS = (int, float, str, bool, type(None))


@dataclass(frozen=True, eq=False)
class DatasetRef:
    """A committed dataset of a step: where it is and what its manifest says.

    ``meta`` holds the manifest's scalar metadata (figures such as ``seconds``, ``reward_mean``);
    ``attempts`` is how often this flow process ran the stage for it (0: it was committed by an
    earlier flow run and only read back). Compared by identity (Prefect links task runs by the
    identity of the objects passed).
    """

    uri: str
    stage: str
    step: int
    rows: int
    weights_version: int | None = None
    checksum: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    attempts: int = 0

    @classmethod
    def from_manifest(cls, manifest: Any, uri: str, *, attempts: int = 0) -> DatasetRef:
        """From a ``storage.Manifest`` (its user metadata carries ``stage``, ``step``, ``weights_version``)."""
        meta = dict(manifest.meta or {})
        wv = meta.get("weights_version")
        return cls(
            uri=uri,
            stage=str(meta.get("stage", "")),
            step=int(meta.get("step") or 0),
            rows=int(manifest.rows),
            weights_version=None if wv is None else int(wv),
            checksum=manifest.checksum,
            meta={k: v for k, v in meta.items() if isinstance(v, _SCALARS)},
            attempts=attempts,
        )

    @property
    def seconds(self) -> float | None:
        return self.meta.get("seconds")

    def get(self, key: str, default: Any = None) -> Any:
        """A figure of the manifest, or one of the reference's own fields (``rows``, ``uri``, ...)."""
        if key in self.meta:
            return self.meta[key]
        if key in ("uri", "stage", "step", "rows", "weights_version", "checksum", "attempts"):
            return getattr(self, key)
        return default

    def summary(self) -> dict[str, Any]:
        """JSON-able dict: the manifest figures plus the reference fields."""
        return {**self.meta, "uri": self.uri, "stage": self.stage, "step": self.step, "rows": self.rows,
                "weights_version": self.weights_version, "checksum": self.checksum, "attempts": self.attempts}

    def with_attempts(self, attempts: int) -> DatasetRef:
        return replace(self, attempts=attempts)


@dataclass(frozen=True, eq=False)
class ActionResult:
    """What a step action without a dataset of its own returns (``refit``, ``checkpoint``)."""

    stage: str
    step: int
    weights_version: int | None
    seconds: float = 0.0
    skipped: bool = False
    attempts: int = 0
    uri: str | None = None
    info: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        if key in ("stage", "step", "weights_version", "seconds", "skipped", "attempts", "uri"):
            return getattr(self, key)
        return self.info.get(key, default)

    def summary(self) -> dict[str, Any]:
        return {**self.info, "stage": self.stage, "step": self.step, "weights_version": self.weights_version,
                "seconds": self.seconds, "skipped": self.skipped, "attempts": self.attempts, "uri": self.uri}


@dataclass(frozen=True, eq=False)
class StepRefs:
    """Everything one step produced (what the metrics line is built from)."""

    step: int
    datasets: Mapping[str, DatasetRef]
    refit: ActionResult | None = None
    checkpoint: ActionResult | None = None
    val: DatasetRef | None = None
    #: the step's own Prefect flow run (its subflow), if it ran as one
    flow_run_id: str | None = None
