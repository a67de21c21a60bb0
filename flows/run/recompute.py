"""Damaged persisted data at resume, and ``nrl resume RUN_ID --recompute STAGE@STEP``.

What a resume reads is checked before anything starts (:func:`check_resume_data`): every
committed dataset of the steps after the *anchor* (the newest checkpoint at or before the last
trained step), whose ``train`` stages resume may replay, and of the next step to train. Each is
loaded with full verification (sizes, checksums, schema); a damaged one (corrupt or missing
shard, unreadable manifest) stops the resume with a :class:`DamagedRunError` that names the file
and gives the ``--recompute`` items that repair it. Steps at or before the anchor are never read
by a resume and are not checked.

``--recompute STAGE@STEP`` deletes outputs so the resumed flow recomputes them:

- a step **not trained yet**: the stage's dataset and what depends on it in that step
  (``generate@4`` deletes rollouts, rewards, logprobs and advantages of step 4);
- a **trained** step after the anchor: only that stage's dataset. Its ``train`` marker stays, and
  the weights checksum that ``train`` recorded is the invariant: resume restores the anchor,
  recomputes the missing datasets of each replayed step (same seeds, the generation workers
  refitted to that step's weights) and replays its ``train``, which must reproduce the recorded
  checksum or the resume stops. A trained step's inputs can be repaired, never changed;
- refused: ``train@STEP`` of a trained step (the weights after it are part of the run) and any
  stage of a step at or before the anchor (a resume never reads those batches, and the weights
  that produced them are not restored).

**DPO** (:func:`dpo_repairs`) has no ``--recompute``: its ``pairs`` (drawn from the run's frozen
pairs) and ``reference`` (the initial weights' logprobs) are the same bytes whenever they are
made, so a damaged one a resume reads is deleted and made again by the resume (a replayed step's
``train`` must still reproduce its recorded checksum); so are the frozen pairs themselves when
their source still holds them (:func:`nrl_tasks.stages.preferences.snapshot_repair`). A damaged
``train`` of a trained step stops the resume, as for GRPO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import storage
from nrl_tasks.run_layout import RunLayout
from nrl_tasks.stages import graph
from nrl_tasks.stages.errors import DamagedRunError
from nrl_tasks.stages.graph import GRPO_GRAPH, StageGraph
from nrl_tasks.stages.resume_plan import read_run_facts

__all__ = [
    "DATASET_STAGE",
    "RECOMPUTE_ALIASES",
    "DamagedDataset",
    "DamagedRunError",
    "apply_recompute",
    "check_resume_data",
    "find_damaged",
    "own_datasets",
    "parse_recompute",
    "plan_recompute",
    "recompute_names",
    "remake_damaged",
    "resume_window",
]

def recompute_names(g: StageGraph) -> dict[str, tuple[str, ...]]:
    """``--recompute`` names of graph ``g`` (stage or dataset names, and ``val``/``validate``) ->
    the datasets they delete in a step not trained yet: the stage's output and everything that
    reads it."""
    return {**{s.name: g.dependants(s.name) for s in g.stages}, **{s.output: g.dependants(s.name) for s in g.stages},
            "val": ("val",), "validate": ("val",)}


def own_datasets(g: StageGraph, name: str) -> tuple[str, ...]:
    """The dataset ``--recompute name`` deletes in a trained step (nothing downstream)."""
    return ("val",) if name in ("val", "validate") else (g.spec(name).output,)


#: dataset name -> the ``--recompute`` stage that makes it (GRPO's stage graph)
DATASET_STAGE: dict[str, str] = dict(graph.DATASET_STAGE)
#: GRPO's ``--recompute`` names (:func:`recompute_names`)
RECOMPUTE_ALIASES: dict[str, tuple[str, ...]] = recompute_names(GRPO_GRAPH)


def parse_recompute(specs: list[str] | None, g: StageGraph = GRPO_GRAPH) -> list[tuple[str, int]]:
    """``["generate@3"]`` -> ``[("generate", 3)]``; ``ValueError`` naming a bad item (``g``: the
    run's stage graph, whose stage and dataset names the items use)."""
    names = recompute_names(g)
    out = []
    for item in specs or []:
        stage, sep, step = str(item).partition("@")
        if not sep or stage not in names or not step.isdigit() or int(step) < 1:
            raise ValueError(
                f"--recompute {item!r}: expected STAGE@STEP with STAGE one of {sorted(names)} and STEP >= 1"
            )
        out.append((stage, int(step)))
    return out


@dataclass(frozen=True)
class DamagedDataset:
    step: int
    dataset: str
    uri: str
    error: str
    trained: bool
    #: the stage that makes it (its ``--recompute`` name)
    stage: str = ""

    @property
    def recompute_item(self) -> str:
        return f"{self.stage or self.dataset}@{self.step}"


def _kw(storage_options: dict[str, Any] | None) -> dict[str, Any]:
    return {"storage_options": storage_options} if storage_options else {}


def resume_window(layout: RunLayout, storage_options: dict[str, Any] | None = None) -> tuple[int, int]:
    """``(anchor, last)``: the resume plan's anchor (:attr:`~nrl_tasks.stages.resume_plan.RunFacts.anchor`,
    the newest checkpoint at or before the last trained step whose files check out; 0 if none) and
    the last trained step. A resume reads the batches of steps ``anchor+1 .. last+1``."""
    facts = read_run_facts(layout, storage_options, verify_checkpoints=True, read_checksums=False)
    return facts.anchor, facts.last_trained


def find_damaged(
    layout: RunLayout,
    storage_options: dict[str, Any] | None = None,
    *,
    skip: Iterable[tuple[int, str]] = (),
    window: tuple[int, int] | None = None,
    g: StageGraph = GRPO_GRAPH,
) -> list[DamagedDataset]:
    """The committed datasets a resume reads that fail full verification (``skip``: ``(step, dataset)``;
    ``window``: the :func:`resume_window`, when the caller has it; ``g``: the run's stage graph)."""

    anchor, last = window or resume_window(layout, storage_options)
    skip = set(skip)
    out = []
    for step in range(anchor + 1, last + 2):
        for ds in g.datasets:
            if (step, ds) in skip or (ds == "train" and step > last):
                continue
            uri = layout.stage_uri(step, ds)
            if not storage.is_committed(uri, **_kw(storage_options)):
                continue  # absent: recomputed by its stage (or before a replay)
            try:
                storage.load_batch(uri, verify=True, mmap=False, **_kw(storage_options))
            except (ValueError, OSError) as exc:  # CorruptDatasetError, MissingShardError, unreadable files
                out.append(DamagedDataset(step, ds, uri, f"{type(exc).__name__}: {exc}", step <= last, g.dataset_stage[ds]))
    return out


def damage_message(layout: RunLayout, damaged: list[DamagedDataset]) -> str:
    """One readable error: each damaged dataset (file and error) and the repair command."""
    lines = [f"run {layout.run_id!r} cannot resume: {len(damaged)} persisted dataset(s) it needs are damaged"]
    for d in damaged:
        kind = "trained step" if d.trained else "step not trained yet"
        lines.append(f"  - step {d.step} {d.dataset} ({kind}): {d.error}")
    fixable = [d for d in damaged if not (d.trained and d.dataset == "train")]
    if fixable:
        items = " ".join(f"--recompute {d.recompute_item}" for d in fixable)
        lines.append("recompute them with:")
        lines.append(f"  nrl resume {layout.run_id} --storage {layout.root} {items}")
        lines.append(
            "(in a trained step only that dataset is recomputed and its replay must reproduce the weights "
            "checksum the step's train recorded; in a step not trained yet the stage and what depends on it "
            "in that step are recomputed)"
        )
    for d in damaged:
        if d.trained and d.dataset == "train":
            lines.append(
                f"step {d.step}'s train marker is damaged: it cannot be recomputed (the weights after it are part "
                "of the run); restore it from a copy or start a new run"
            )
    return "\n".join(lines)


def check_resume_data(
    layout: RunLayout,
    storage_options: dict[str, Any] | None = None,
    *,
    skip: Iterable[tuple[int, str]] = (),
    window: tuple[int, int] | None = None,
    g: StageGraph = GRPO_GRAPH,
) -> None:
    """Raise :class:`DamagedRunError` if a dataset a resume reads is damaged (see the module docstring)."""
    damaged = find_damaged(layout, storage_options, skip=skip, window=window, g=g)
    if damaged:
        raise DamagedRunError(damage_message(layout, damaged))


def remake_damaged(
    layout: RunLayout, storage_options: dict[str, Any] | None, *, window: tuple[int, int], g: StageGraph,
    skip: Iterable[tuple[int, str]] = (), snapshot: str | None = None,
) -> tuple[str, ...]:
    """The damaged datasets a resume reads that it deletes and makes again, for a run whose step
    inputs are the same bytes whenever they are made (DPO, SFT: drawn from the run's frozen data,
    no sampling): ``snapshot`` (a damaged frozen copy its source can rebuild), then each step's
    datasets before ``train``. :class:`DamagedRunError` naming the file when a ``train`` is damaged."""
    damaged = find_damaged(layout, storage_options, window=window, g=g, skip=skip)
    lost = [d for d in damaged if d.dataset == "train"]
    if lost:
        raise DamagedRunError(damage_message(layout, lost))
    return (*([snapshot] if snapshot else []), *(d.uri for d in damaged))


def plan_recompute(
    layout: RunLayout,
    specs: list[tuple[str, int]],
    storage_options: dict[str, Any] | None = None,
    *,
    window: tuple[int, int] | None = None,
    g: StageGraph = GRPO_GRAPH,
) -> list[tuple[int, str]]:
    """``(step, dataset)`` pairs that ``specs`` delete; ``ValueError`` for a refused item."""
    names = recompute_names(g)
    anchor, last = window or resume_window(layout, storage_options)
    plan: list[tuple[int, str]] = []
    for stage, step in specs:
        if stage in ("val", "validate"):
            plan += [(step, "val")]
            continue
        if step > last + 1:
            raise ValueError(
                f"--recompute {stage}@{step}: the run has trained {last} step(s); step {step} is not reached yet"
            )
        if step <= last:
            if stage == "train":
                raise ValueError(
                    f"--recompute train@{step}: step {step} is trained and the weights after it are part of the run; "
                    "a trained step's result cannot be recomputed (start a new run to change it)"
                )
            if step <= anchor:
                raise ValueError(
                    f"--recompute {stage}@{step}: step {step} is covered by the checkpoint of step {anchor}; resume "
                    "never reads its batches and the weights that produced them are not restored, so it cannot be recomputed"
                )
            plan += [(step, ds) for ds in own_datasets(g, stage)]
        else:
            plan += [(step, ds) for ds in names[stage]]
    return list(dict.fromkeys(plan))


def apply_recompute(
    layout: RunLayout,
    specs: list[tuple[str, int]],
    storage_options: dict[str, Any] | None = None,
    *,
    deletes: Iterable[tuple[int, str]] | None = None,
) -> list[str]:
    """Delete what :func:`plan_recompute` names (manifest first: never half-valid); the deleted URIs.
    ``deletes``: that list when the caller has it (the resume entry planned it), so the run's
    checkpoint files are not verified a second time."""

    deleted = []
    for step, ds in plan_recompute(layout, specs, storage_options) if deletes is None else deletes:
        uri = layout.stage_uri(step, ds)
        if storage.exists(uri, storage_options=storage_options):
            storage.delete_batch(uri, **_kw(storage_options))
            deleted.append(uri)
    return deleted
