"""Storage retention of a run: drop old step batches and the checkpoints a policy does not keep.

Settings (all ``None`` by default: keep everything):

- ``storage.keep_last_k_steps = K``: keep the bulky batches (``prompts``, ``rollouts``,
  ``rewards``, ``logprobs``, ``advantages``) of the newest ``K`` trained steps;
- ``checkpointing.keep_last_k = N``: keep the newest ``N`` checkpoints;
- ``checkpointing.keep_top_k = T``: keep the ``T`` best checkpoints by
  ``checkpointing.metric_name`` (default ``val_accuracy``, a column of ``metrics.jsonl``;
  ``checkpointing.higher_is_better``). Checkpoints of steps without that metric never rank.

What resume needs is never deleted, whatever the settings:

- the *anchor*: the newest committed checkpoint at or before the last trained step (resume
  restores it);
- the batches of every step after the anchor (resume replays their ``train`` from them), and
  of every step not trained yet;
- the ``train`` dataset of every step (its manifest marks the step trained: resume finds the
  trained prefix from them; one row of metrics) and ``val`` datasets (evaluation results).

In async GRPO (age ``a``) the flow passes ``step - a`` as the trained prefix after step
``step``: the steps generated ahead on older weights may be lost with the flow, and their resume
restores the newest checkpoint at or before version ``step - a``
(:mod:`nrl_tasks.stages.resume_plan`).

So without any checkpoint no batch is ever deleted. A deleted step can no longer be
recomputed (``--recompute``) or replayed; a deleted checkpoint can no longer be evaluated.

A checkpoint held by a reader (an evaluation: :mod:`nrl_tasks.stages.holds`) is not deleted;
it stays until a pass after the hold is released (or its holder died).

Deletion is crash-safe: a dataset's manifest (its commit) goes before its shards, a
checkpoint's ``checkpoint.json`` before its files, so a half-deleted item is never read as
valid; re-running the same retention finishes the job (idempotent).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import storage
from flows.observe.metrics import read_metrics
from flows.run.state import existing_steps
from nrl_tasks.run_layout import GEN_BATCHES_DIR, RunLayout, checkpoint_name, join_uri
from nrl_tasks.stages.checkpoint import COMMIT_FILE, list_checkpoints
from nrl_tasks.stages.graph import STEP_INPUTS
from nrl_tasks.stages.holds import is_held, mark_deleting
from storage import fs

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.config.master import MasterConfig

__all__ = [
    "PRUNABLE_STAGES",
    "RetentionPlan",
    "RetentionPolicy",
    "apply_retention",
    "delete_unheld_checkpoint",
    "plan_retention",
]

logger = logging.getLogger(__name__)

#: Datasets of a step that retention may delete (``train`` and ``val`` are always kept).
PRUNABLE_STAGES: tuple[str, ...] = STEP_INPUTS


@dataclass(frozen=True)
class RetentionPolicy:
    """What to keep. ``None`` keeps all of that kind.

    >>> RetentionPolicy(keep_last_k_steps=0)
    Traceback (most recent call last):
    ...
    ValueError: retention: keep_last_k_steps must be None or >= 1, got 0
    """

    keep_last_k_steps: int | None = None
    keep_last_n_checkpoints: int | None = None
    keep_top_k_checkpoints: int | None = None
    metric_name: str = "val_accuracy"
    higher_is_better: bool = True

    def __post_init__(self) -> None:
        for name in ("keep_last_k_steps", "keep_last_n_checkpoints", "keep_top_k_checkpoints"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"retention: {name} must be None or >= 1, got {v!r}")

    @classmethod
    def from_config(cls, cfg: MasterConfig) -> "RetentionPolicy":
        """From a ``MasterConfig`` (``storage.keep_last_k_steps``, ``checkpointing.*``)."""
        ck = cfg.checkpointing
        return cls(
            keep_last_k_steps=cfg.storage.keep_last_k_steps,
            keep_last_n_checkpoints=ck.keep_last_k,
            keep_top_k_checkpoints=getattr(ck, "keep_top_k", None),
            metric_name=getattr(ck, "metric_name", "val_accuracy"),
            higher_is_better=getattr(ck, "higher_is_better", True),
        )

    @property
    def prunes_checkpoints(self) -> bool:
        return self.keep_last_n_checkpoints is not None or self.keep_top_k_checkpoints is not None

    @property
    def active(self) -> bool:
        return self.keep_last_k_steps is not None or self.prunes_checkpoints


@dataclass(frozen=True)
class RetentionPlan:
    """The outcome of :func:`plan_retention` (steps are sorted ascending)."""

    anchor: int | None
    delete_steps: list[int] = field(default_factory=list)
    keep_steps: list[int] = field(default_factory=list)
    delete_checkpoints: list[int] = field(default_factory=list)
    keep_checkpoints: list[int] = field(default_factory=list)


def _rank_key(score: float, step: int, higher_is_better: bool) -> tuple[float, int]:
    # best first; ties go to the newer checkpoint
    return (-score if higher_is_better else score, -step)


def plan_retention(
    policy: RetentionPolicy,
    *,
    last_trained: int,
    batch_steps: Iterable[int],
    checkpoint_steps: Iterable[int],
    scores: Mapping[int, float] | None = None,
) -> RetentionPlan:
    """Decide what to delete. Pure: touches no storage.

    Args:
        last_trained: the run's trained prefix (every step ``1..last_trained`` is trained).
        batch_steps: steps that still hold prunable batches.
        checkpoint_steps: steps of the committed checkpoints.
        scores: ``{step: metric}`` for ranking checkpoints (NaN or missing: unranked).

    >>> p = RetentionPolicy(keep_last_k_steps=2, keep_last_n_checkpoints=1, keep_top_k_checkpoints=1)
    >>> plan = plan_retention(p, last_trained=10, batch_steps=range(1, 11), checkpoint_steps=[4, 6, 8],
    ...                       scores={4: 0.9, 6: 0.1, 8: 0.2})
    >>> plan.anchor, plan.delete_checkpoints, plan.keep_checkpoints
    (8, [6], [4, 8])
    >>> plan.delete_steps, plan.keep_steps
    ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10])
    """
    if last_trained < 0:
        raise ValueError(f"retention: last_trained must be >= 0, got {last_trained}")
    ckpts = sorted(set(int(s) for s in checkpoint_steps))
    steps = sorted(set(int(s) for s in batch_steps))
    eligible = [s for s in ckpts if s <= last_trained]
    anchor = eligible[-1] if eligible else None

    keep_ck = set(ckpts)
    if policy.prunes_checkpoints:
        keep_ck = {s for s in ckpts if s > last_trained}  # not the run's prefix: leave alone
        if anchor is not None:
            keep_ck.add(anchor)
        if policy.keep_last_n_checkpoints is not None:
            keep_ck.update(eligible[-policy.keep_last_n_checkpoints :])
        if policy.keep_top_k_checkpoints is not None:
            ranked = [
                s for s in eligible
                if scores is not None and s in scores and scores[s] is not None and not math.isnan(float(scores[s]))
            ]
            ranked.sort(key=lambda s: _rank_key(float(scores[s]), s, policy.higher_is_better))  # type: ignore[index]
            keep_ck.update(ranked[: policy.keep_top_k_checkpoints])

    delete_steps: list[int] = []
    if policy.keep_last_k_steps is not None and anchor is not None:
        # a step may go only if resume does not replay it (<= anchor) and it is not among the newest K
        cutoff = min(anchor, last_trained - policy.keep_last_k_steps)
        delete_steps = [s for s in steps if s <= cutoff]
    gone = set(delete_steps)
    return RetentionPlan(
        anchor=anchor,
        delete_steps=delete_steps,
        keep_steps=[s for s in steps if s not in gone],
        delete_checkpoints=[s for s in ckpts if s not in keep_ck],
        keep_checkpoints=sorted(keep_ck),
    )


# ----------------------------------------------------------------------------------------------
# applying a plan to storage

def _step_has_batches(layout: RunLayout, step: int, opts: dict[str, Any] | None, prunable: tuple[str, ...]) -> bool:
    uri = layout.step_uri(step)
    if not fs.exists(uri, storage_options=opts):
        return False
    names = {e.rstrip("/").rsplit("/", 1)[-1] for e in fs.list_dir(uri, storage_options=opts)}
    return any(s in names for s in (*prunable, GEN_BATCHES_DIR))


def delete_step_batches(
    layout: RunLayout, step: int, storage_options: dict[str, Any] | None = None, prunable: tuple[str, ...] = PRUNABLE_STAGES,
) -> list[str]:
    """Delete the prunable datasets of ``step`` (``prunable``: the step's datasets before ``train``
    in its algorithm's stage graph; manifest first); returns the URIs deleted."""

    kw = {"storage_options": storage_options} if storage_options else {}
    out = []
    for stage in prunable:
        uri = layout.stage_uri(step, stage)
        if fs.exists(uri, storage_options=storage_options):
            storage.delete_batch(uri, **kw)
            fs.remove(uri, recursive=True, storage_options=storage_options)  # stray leftovers too
            out.append(uri)
    gen_batches = layout.gen_batches_uri(step)  # dynamic sampling's generation batches
    if fs.exists(gen_batches, storage_options=storage_options):
        for entry in sorted(fs.list_dir(gen_batches, storage_options=storage_options)):
            batch_dir = entry.rstrip("/").rsplit("/", 1)[-1]
            for stage in ("rollouts", "rewards", "prompts"):
                uri = join_uri(gen_batches, batch_dir, stage)
                if fs.exists(uri, storage_options=storage_options):
                    storage.delete_batch(uri, **kw)
        fs.remove(gen_batches, recursive=True, storage_options=storage_options)
        out.append(gen_batches)
    return out


def delete_checkpoint(uri: str, storage_options: dict[str, Any] | None = None) -> None:
    """Uncommit (``checkpoint.json`` first), then delete a checkpoint's files; idempotent."""

    fs.remove(join_uri(uri, COMMIT_FILE), storage_options=storage_options)
    fs.remove(uri, recursive=True, storage_options=storage_options)


def delete_unheld_checkpoint(
    layout: RunLayout, step: int, uri: str, storage_options: dict[str, Any] | None = None
) -> bool:
    """Delete checkpoint ``step`` unless a reader holds it (:mod:`nrl_tasks.stages.holds`);
    ``False`` when held (or another retention is deleting it): it stays for a later pass.

    The deletion mark goes before the look for holds, as a reader's hold goes before its look
    for the mark and for ``checkpoint.json``: of a racing pair, at least one sees the other.
    """

    name = checkpoint_name(step)
    if is_held(layout, name, storage_options):
        return False
    mark = mark_deleting(layout, name, storage_options)
    if mark is None:
        return False
    with mark:
        if is_held(layout, name, storage_options):  # a hold taken since the plan: keep it
            return False
        delete_checkpoint(uri, storage_options)
    return True


def checkpoint_scores(layout: RunLayout, metric_name: str, storage_options: dict[str, Any] | None = None) -> dict[int, float]:
    """``{step: metric}`` from ``metrics.jsonl`` (steps where the metric is recorded)."""

    out = {}
    for row in read_metrics(layout.metrics_uri, storage_options):
        v = row.get(metric_name)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[int(row["step"])] = float(v)
    return out


def apply_retention(
    layout: RunLayout,
    policy: RetentionPolicy,
    last_trained: int,
    storage_options: dict[str, Any] | None = None,
    *,
    pruned: set[int] | None = None,
    prunable: tuple[str, ...] = PRUNABLE_STAGES,
) -> dict[str, Any]:
    """Plan and carry out retention for a run after step ``last_trained`` has finished
    (``prunable``: a step's datasets before ``train``, its algorithm's; GRPO's by default).

    Returns ``{"anchor", "deleted_steps", "deleted_checkpoints", "kept_checkpoints",
    "held_checkpoints"}`` (held: planned for deletion but held by a reader, so kept this time).
    ``pruned``: the caller's record of the steps found without batches (the flow keeps one per
    run and passes it every step, so each step's directory is inspected once; updated in place).
    """
    result: dict[str, Any] = {
        "anchor": None, "deleted_steps": [], "deleted_checkpoints": [], "kept_checkpoints": [], "held_checkpoints": [],
    }
    if not policy.active:
        return result

    cks = list_checkpoints(layout.checkpoints_uri, storage_options)
    ck_uri = dict(cks)
    pruned = pruned if pruned is not None else set()
    candidates: list[int] = []
    if policy.keep_last_k_steps is not None:
        for s in existing_steps(layout, storage_options):
            if s in pruned or s > last_trained - policy.keep_last_k_steps:
                continue
            if _step_has_batches(layout, s, storage_options, prunable):
                candidates.append(s)
            else:
                pruned.add(s)
    scores = checkpoint_scores(layout, policy.metric_name, storage_options) if policy.keep_top_k_checkpoints else None
    plan = plan_retention(
        policy, last_trained=last_trained, batch_steps=candidates, checkpoint_steps=ck_uri, scores=scores
    )
    deleted_ck, held_ck = [], []
    for s in plan.delete_checkpoints:
        (deleted_ck if delete_unheld_checkpoint(layout, s, ck_uri[s], storage_options) else held_ck).append(s)
    for s in plan.delete_steps:
        delete_step_batches(layout, s, storage_options, prunable)
        pruned.add(s)
    if plan.delete_steps or deleted_ck:
        logger.info(
            "retention of %s: deleted batches of steps %s, checkpoints %s (anchor %s)",
            layout.run_id, plan.delete_steps, deleted_ck, plan.anchor,
        )
    if held_ck:
        logger.info("retention of %s: checkpoints %s are held by a reader; left for a later pass", layout.run_id, held_ck)
    result.update(
        anchor=plan.anchor,
        deleted_steps=plan.delete_steps,
        deleted_checkpoints=deleted_ck,
        kept_checkpoints=sorted(plan.keep_checkpoints + held_ck),
        held_checkpoints=held_ck,
    )
    return result
