"""Where a run's files live on storage (local path, ``file://`` or ``s3://``).

::

    <root>/<run_id>/
      config.yaml                 resolved config (with its hash)
      status.json                 last step, status, flow-run id (for ``nrl runs``)
      metrics.jsonl               one line per step, keyed by step
      steps/step_000007/<stage>/  Arrow dataset of one stage (``_manifest.json`` = commit)
      checkpoints/step_000008/    HF safetensors + optimizer + RNG + cursor
      evals/<checkpoint>/         evaluation samples (Arrow) + ``summary.json``

Steps are numbered from 1; ``checkpoints/step_000008`` holds the weights after the
``train`` stage of step 8 (weights version 8).

>>> lay = RunLayout("s3://bucket/runs/", "r1")
>>> lay.stage_uri(7, "rollouts")
's3://bucket/runs/r1/steps/step_000007/rollouts'
>>> lay.checkpoint_uri(8)
's3://bucket/runs/r1/checkpoints/step_000008'
>>> parse_step_dir("step_000012")
12
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nrl_tasks.stages.graph import DATA_STAGES as _GRAPH_DATASETS

__all__ = [
    "DATA_STAGES",
    "RunLayout",
    "checkpoint_name",
    "join_uri",
    "namespace_for",
    "parse_step_dir",
    "step_dir",
    "validate_run_id",
]

#: Stages whose output is a persisted batch, in pipeline order (from the stage graph).
DATA_STAGES: tuple[str, ...] = _GRAPH_DATASETS

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_STEP_RE = re.compile(r"^step_(\d{6,})$")


def join_uri(base: str, *parts: str) -> str:
    """Join URI or path pieces with ``/`` (no normalisation of ``..``).

    >>> join_uri("runs/", "a", "b/")
    'runs/a/b'
    """
    out = base.rstrip("/")
    for p in parts:
        p = str(p).strip("/")
        if p:
            out = f"{out}/{p}" if out else p
    return out


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` or raise ``ValueError`` (letters, digits, ``_.-``; ≤128 chars).

    >>> validate_run_id("grpo-tiny_1")
    'grpo-tiny_1'
    """
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise ValueError(
            f"run_id {run_id!r} is invalid: use 1-128 characters from [A-Za-z0-9_.-], "
            "starting with a letter or digit"
        )
    return run_id


#: a step's subdirectory holding its generation batches (dynamic sampling)
GEN_BATCHES_DIR = "gen_batches"


def step_dir(step: int) -> str:
    """``step_000007`` for step 7."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:06d}"


def checkpoint_name(step: int) -> str:
    """Name of the checkpoint holding the weights after training ``step``."""
    return step_dir(step)


def parse_step_dir(name: str) -> int | None:
    """Step number of a ``step_NNNNNN`` directory name, ``None`` for anything else."""
    m = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RunLayout:
    """URIs of everything a run writes. Pure string manipulation; touches no storage."""

    root: str
    run_id: str

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)

    @property
    def run_uri(self) -> str:
        return join_uri(self.root, self.run_id)

    @property
    def config_uri(self) -> str:
        return join_uri(self.run_uri, "config.yaml")

    @property
    def status_uri(self) -> str:
        return join_uri(self.run_uri, "status.json")

    @property
    def metrics_uri(self) -> str:
        return join_uri(self.run_uri, "metrics.jsonl")

    @property
    def steps_uri(self) -> str:
        return join_uri(self.run_uri, "steps")

    def step_uri(self, step: int) -> str:
        return join_uri(self.steps_uri, step_dir(step))

    def stage_uri(self, step: int, stage: str) -> str:
        """Dataset URI of ``stage`` at ``step`` (e.g. ``rollouts``, ``val``)."""
        if not stage or "/" in stage:
            raise ValueError(f"invalid stage name {stage!r}")
        return join_uri(self.step_uri(step), stage)

    def gen_batches_uri(self, step: int) -> str:
        """Directory of ``step``'s generation batches (dynamic sampling)."""
        return join_uri(self.step_uri(step), GEN_BATCHES_DIR)

    def gen_batch_uri(self, step: int, gen_batch: int, stage: str) -> str:
        """Dataset URI of ``stage`` in generation batch ``gen_batch`` of ``step`` (dynamic sampling:
        ``steps/step_000007/gen_batches/001/rollouts``)."""
        if not stage or "/" in stage:
            raise ValueError(f"invalid stage name {stage!r}")
        return join_uri(self.gen_batches_uri(step), f"{int(gen_batch):03d}", stage)

    @property
    def checkpoints_uri(self) -> str:
        return join_uri(self.run_uri, "checkpoints")

    def checkpoint_uri(self, step: int) -> str:
        return join_uri(self.checkpoints_uri, checkpoint_name(step))

    @property
    def evals_uri(self) -> str:
        return join_uri(self.run_uri, "evals")

    def eval_uri(self, checkpoint: str) -> str:
        return join_uri(self.evals_uri, checkpoint)

    @property
    def namespace(self) -> str:
        """Ray namespace of the run's actors."""
        return namespace_for(self.run_id)


def namespace_for(run_id: str) -> str:
    """Ray namespace of a run's actors.

    >>> namespace_for("r1")
    'nrl-r1'
    """
    return f"nrl-{run_id}"
