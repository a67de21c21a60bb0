"""What the recipes of DPO and SFT share (:class:`SupervisedRecipe`, the small base class of
both): both train the policy alone on batches drawn from the run's frozen data, at age 0, with
NeMo-RL's validation keys.

- their schedule is age 0 over ``<section>.max_num_steps`` and their retry settings the defaults;
- a resume reads the facts of their own stage graph, and remakes a damaged step input instead of
  refusing (the pairs, the reference logprobs and the SFT batches are the same bytes whenever they
  are made: no sampling), as long as the frozen data can be made again
  (:func:`flows.run.recompute.remake_damaged`);
- their metrics line is the train stage's figures, the validation's ``val_*`` figures and every
  algorithm's stage seconds and attempts (:func:`flows.observe.metrics.stage_figures`); a lost
  line is rebuilt from the same manifests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prefect.utilities.annotations import quote

from flows.algorithms.training import recipe_flow
from flows.config import MasterConfig
from flows.observe.metrics import mark_rebuilt, stage_figures, stored_step
from flows.algorithms.epochs import RowLoader, epoch_problems, epoch_steps, train_row_count
from flows.run.recipe import Actors, Retries
from flows.run.recompute import remake_damaged
from nrl_tasks.run_layout import RunLayout
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.graph import StageGraph
from nrl_tasks.stages.refs import DatasetRef, StepRefs
from nrl_tasks.stages.schedule import StepSchedule

__all__ = [
    "DEFAULT_RETRIES", "SupervisedRecipe", "console_line", "facts_options", "line_from_manifests", "metrics_line",
    "rebuild_line", "repairs", "schedule", "validation_due",
]

#: DPO and SFT runs retry a stage that met an actor fault as GRPO's defaults do
DEFAULT_RETRIES = Retries()


def schedule(budget: int) -> StepSchedule:
    """Age 0 over ``budget`` steps."""
    return StepSchedule(budget)


def validation_due(section: Any, step: int, last: int) -> bool:
    """``val_period`` steps apart (0: none); step 0 (the initial weights) with ``val_at_start``
    and ``val_period``; step ``last`` (the run's budget) with ``val_at_end``."""
    if step and step == last and section.val_at_end:
        return True
    if not section.val_period:
        return False
    return bool(section.val_at_start) if step == 0 else step % section.val_period == 0


def facts_options(graph: StageGraph, budget: int) -> dict[str, Any]:
    """:func:`~nrl_tasks.stages.resume_plan.read_run_facts` options of a run of ``graph``."""
    return {"max_steps": budget, "step_inputs": graph.step_inputs}


def repairs(layout: RunLayout, cfg: Any, graph: StageGraph, window: tuple[int, int], skip: Sequence[tuple[int, str]],
            snapshot: str | None) -> tuple[str, ...]:
    """The damaged datasets a resume reads that the flow deletes and makes again (``snapshot``: a
    damaged frozen copy its source rebuilds), or ``DamagedRunError`` naming a damaged ``train``."""
    return remake_damaged(layout, cfg.storage.storage_options or None, window=window, g=graph, skip=skip, snapshot=snapshot)


def line_from_manifests(
    step: int, graph: StageGraph, manifests: Mapping[str, Mapping[str, Any] | None], train_keys: Sequence[str], *,
    refit: Mapping[str, Any] | None = None, val: Mapping[str, Any] | None = None,
    checkpoint: Mapping[str, Any] | None = None, wall_seconds: float | None = None,
) -> dict[str, Any]:
    """A metrics line: ``train_keys`` of the ``train`` manifest, the validation's ``val_*``
    figures and the stage figures every algorithm has."""
    train = manifests.get("train") or {}
    row: dict[str, Any] = {"step": step, "weights_version": step, **{k: train.get(k) for k in train_keys}}
    val_figures = {k: v for k, v in (val or {}).items() if k.startswith("val_")}
    compute = [train.get("train_seconds"), *((m or {}).get("compute_seconds") for d, m in manifests.items() if d != "train")]
    row.update(stage_figures(graph, manifests, compute, refit=refit, val=val, val_figures=val_figures, checkpoint=checkpoint,
                             wall_seconds=wall_seconds))
    return row


def metrics_line(ctx: StepContext, refs: StepRefs, wall_seconds: float | None, graph: StageGraph,
                 train_keys: Sequence[str]) -> dict[str, Any]:
    """The step's line from its references (the datasets' manifests, checkpoint and validation)."""
    return line_from_manifests(
        ctx.step, graph, {k: v.summary() for k, v in refs.datasets.items() if v is not None}, train_keys,
        refit=refs.refit.summary() if refs.refit else None, val=refs.val.summary() if refs.val else None,
        checkpoint=refs.checkpoint.summary() if refs.checkpoint else None, wall_seconds=wall_seconds,
    )


def rebuild_line(layout: RunLayout, step: int, storage_options: dict[str, Any] | None, graph: StageGraph,
                 train_keys: Sequence[str]) -> dict[str, Any]:
    """A lost line of trained step ``step`` from what storage holds, marked ``rebuilt`` (its
    attempts, ``step_s`` and ``orchestration_s`` unknown)."""
    manifests, val, checkpoint = stored_step(layout, step, graph.datasets, storage_options)
    return mark_rebuilt(line_from_manifests(step, graph, manifests, train_keys, val=val, checkpoint=checkpoint))


def console_line(run_id: str, kind: str, row: Mapping[str, Any], max_steps: int, figures: Sequence[tuple[str, str, str]]) -> str:
    """``[run] dpo step 3/10 loss 0.6931 accuracy 0.500 | val_loss 0.69 | step 1.23s = work 0.80s + orchestration 0.43s``:
    ``figures`` are ``(label, key, format)`` of the row."""

    def fmt(key: str, spec: str) -> str:
        v = row.get(key)
        return "n/a" if v is None else format(v, spec)

    parts = [f"[{run_id}] {kind} step {row['step']}/{max_steps}", *(f"{label} {fmt(key, spec)}" for label, key, spec in figures)]
    vals = [f"{k} {row[k]:.4f}" for k in ("val_loss", "val_accuracy") if isinstance(row.get(k), (int, float))]
    tail = ""
    if row.get("step_s") is not None:
        tail = f" | step {row['step_s']:.2f}s"
        if row.get("orchestration_s") is not None:
            tail += f" = work {row['step_s'] - row['orchestration_s']:.2f}s + orchestration {row['orchestration_s']:.2f}s"
    retried = [f"{k[: -len('_attempts')]} x{row[k]}" for k in row if k.endswith("_attempts") and isinstance(row[k], int) and row[k] > 1]
    return " ".join(parts) + (" | " + " ".join(vals) if vals else "") + tail + (" | attempts " + " ".join(retried) if retried else "")


class SupervisedRecipe:
    """The parts of DPO's and SFT's recipes that are the same (see the module docstring); a
    subclass sets ``kind``, ``section``, ``graph``, ``unread_sections``, ``summary``,
    ``train_keys`` (the ``train`` figures of its metrics line) and ``console_figures``
    (``(label, key, format)`` of its console line) and implements its data and stages."""

    actors = Actors()
    product = "policy"
    section: str
    graph: StageGraph
    train_keys: tuple[str, ...] = ()
    console_figures: tuple[tuple[str, str, str], ...] = ()
    #: its one update from a step's batches (what its train stage runs and a replay repeats)
    update_fn: Callable[[RunContext, Mapping[str, Any]], dict[str, float]]
    #: its validation task (``ctx`` quoted -> the step's ``val``)
    validate_task: Callable[[Any], DatasetRef]
    #: ``load(data_cfg, split, seed, storage_options)``: a split's rows (:mod:`flows.algorithms.epochs`)
    row_loader: RowLoader

    def row_seed(self, cfg: MasterConfig) -> int:
        """The seed its ``row_loader`` draws the built-in task's rows (and the held-out slice) with."""
        raise NotImplementedError

    def train_once(self, run: RunContext, batches: Mapping[str, Any]) -> dict[str, float]:
        return self.update_fn(run, batches)

    def validate(self, ctx: StepContext, refit: Any) -> DatasetRef:
        return self.validate_task(quote(ctx))

    def run(self, **params: Any) -> dict[str, Any]:
        """A run of this recipe: its Prefect flow (:func:`flows.algorithms.training.recipe_flow`)."""
        return recipe_flow(self)(**params)

    def _section(self, cfg: MasterConfig) -> Any:
        return getattr(cfg, self.section)

    def budget(self, cfg: MasterConfig) -> int:
        """``<section>.max_num_steps``, or fewer: ``max_num_epochs`` passes over the train rows at
        ``policy.train_global_batch_size`` a step (NeMo-RL's ``max_num_epochs * len(dataloader)``,
        the dataloader dropping a last partial batch)."""
        section = self._section(cfg)
        return epoch_steps(section.max_num_steps, section.max_num_epochs, lambda: self.train_rows(cfg),
                           cfg.policy.train_global_batch_size)

    def train_rows(self, cfg: MasterConfig) -> int:
        """Rows of the run's train split (``max_num_epochs``): its ``row_loader``'s, drawn with ``row_seed``."""
        return train_row_count(self.row_loader, cfg, self.row_seed(cfg))

    def epoch_problems(self, cfg: MasterConfig) -> list[str]:
        """``max_num_epochs`` with too few train rows for one step."""
        return epoch_problems(self.section, self._section(cfg).max_num_epochs, lambda: self.train_rows(cfg),
                              cfg.policy.train_global_batch_size, "policy.train_global_batch_size", "rows")

    def validation_due(self, cfg: MasterConfig, step: int) -> bool:
        return validation_due(self._section(cfg), step, self.budget(cfg))

    def stop_rule(self, cfg: MasterConfig) -> None:
        return None  # NeMo-RL's DPO and SFT have no early stop

    def reference_weights(self, cfg: MasterConfig) -> bool:
        return False  # SFT (DPO overrides it)

    def retries(self, cfg: MasterConfig) -> Retries:
        return DEFAULT_RETRIES

    def schedule(self, cfg: MasterConfig) -> StepSchedule:
        return schedule(self.budget(cfg))

    def facts_options(self, cfg: MasterConfig) -> dict[str, Any]:
        return facts_options(self.graph, self.budget(cfg))

    def check_recompute(self, specs: Sequence[tuple[str, int]], cfg: MasterConfig) -> None:
        return None

    def submit_inputs(self, ctx: StepContext, version: int, after: Any = None) -> dict[str, Any]:
        return self.inputs(ctx, version)  # type: ignore[attr-defined]  # never submitted: age 0

    def metrics_line(self, ctx: StepContext, refs: StepRefs, wall_seconds: float | None) -> dict[str, Any]:
        return metrics_line(ctx, refs, wall_seconds, self.graph, self.train_keys)

    def rebuild_line(self, layout: RunLayout, step: int, storage_options: dict[str, Any] | None) -> dict[str, Any]:
        return rebuild_line(layout, step, storage_options, self.graph, self.train_keys)

    def console_line(self, run_id: str, row: Mapping[str, Any], max_steps: int) -> str:
        return console_line(run_id, self.section, row, max_steps, self.console_figures)

    def publish_extra(self, ctx: StepContext, refs: StepRefs) -> list[tuple[str, str]]:
        return []
