"""What an algorithm is to the rest of nrl-flows: the :class:`Recipe` interface.

The run session, the resume entry (:mod:`flows.run.start`), recovery (:mod:`flows.run.recovery`),
the step driver (:mod:`flows.algorithms.driver`) and publishing ask a run's recipe, never the
algorithm's name, for what differs between algorithms::

    recipe.kind, recipe.section          # "dpo": its keys live in the config's `dpo` section
    recipe.budget(cfg)                   # its <section>.max_num_steps
    recipe.graph                         # its data stages (nrl_tasks.stages.graph.StageGraph)
    gen = recipe.inputs(ctx, version)    # the stages before the policy (GRPO: prompts, generate, score)
    data = recipe.update(ctx, gen)       # the policy's stages, `train` last (GRPO: logprob, advantages, train)
    recipe.validate(ctx, refit)          # when due
    recipe.stop_rule(cfg)                # an early stop on a validation figure (GRPO's NeMo-RL keys), or None
    recipe.train_once(run, batches)      # one update from persisted batches (what a resume replays)
    recipe.metrics_line(ctx, refs, wall) # the metrics.jsonl line; console_line, summary fields

The one "finish the step" path (checkpoint beside the refit, validation: :mod:`flows.algorithms.step`)
and retention, trackers, the summary and recovery are the same for every recipe. Each algorithm
is one module implementing this (``flows/algorithms/grpo.py``, ``dpo.py``, ``sft.py``) plus one
line in :mod:`flows.algorithms.registry`, which maps a run's kind to its recipe; a recipe outside
the package is named ``module:attribute`` in the config's ``algorithm`` key.

This module sits in ``flows/run`` (below ``flows/algorithms``) so that the run layer can type
against the interface without importing any algorithm.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from flows.observe.summary import SummaryFields

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.config.master import MasterConfig
    from nrl_tasks.run_layout import RunLayout
    from nrl_tasks.stages.context import RunContext, StepContext
    from nrl_tasks.stages.graph import StageGraph
    from nrl_tasks.stages.refs import ActionResult, DatasetRef, StepRefs

__all__ = ["Actors", "Recipe", "Retries", "StopRule", "SummaryFields"]


@dataclass(frozen=True)
class Actors:
    """The actor groups a recipe's runs use besides the policy."""

    generation: bool = False
    reward_model: bool = False
    environment: bool = False
    #: on-policy distillation's teacher (a Policy without optimizer)
    teacher: bool = False
    #: PPO's value model (a trained one-output head; checkpoints hold it beside the policy)
    value: bool = False


@dataclass(frozen=True)
class Retries:
    """How often a step's stage (and the refit) is run again after an actor fault, and the delays
    before each attempt (the last delay repeats)."""

    stage: int = 3
    stage_delays: Sequence[float] = (1.0, 2.0, 4.0)
    refit: int = 3
    refit_delays: Sequence[float] = (1.0, 2.0, 4.0)


@dataclass(frozen=True)
class StopRule:
    """End the run after the first validated step whose figure ``column`` (a metrics column, e.g.
    ``val_accuracy``) is at least ``threshold``; ``key`` names the config key that asked for it."""

    column: str
    threshold: float
    key: str

    def reached(self, figures: Mapping[str, Any]) -> str | None:
        """The message saying why the run stops after a validation with ``figures``, or None.

        >>> StopRule("val_accuracy", 0.5, "grpo.stop_at_validation_metric").reached({"val_accuracy": 0.625})
        'val_accuracy 0.6250 >= 0.5 (grpo.stop_at_validation_metric): the run stops here'
        >>> StopRule("val_accuracy", 0.5, "k").reached({"val_accuracy": 0.25}) is None
        True
        """
        value = figures.get(self.column)
        if not isinstance(value, (int, float)) or value < self.threshold:
            return None
        return f"{self.column} {value:.4f} >= {self.threshold} ({self.key}): the run stops here"


@runtime_checkable
class Recipe(Protocol):
    """One algorithm (see the module docstring). Implementations are small objects without state:
    everything a run holds is on its :class:`~nrl_tasks.stages.context.RunContext`."""

    #: the run kind recorded in the run's config (its section, or its ``algorithm`` key) and status
    kind: str
    #: the config section holding its keys (``max_num_steps`` among them)
    section: str
    #: its step's data stages
    graph: StageGraph
    #: actor groups its runs need besides the policy
    actors: Actors
    #: what its checkpoints hold: ``"policy"`` (a causal LM the next stage starts from) or
    #: ``"reward_model"`` (a sequence classifier the next stage scores with, ``env.reward_model``)
    product: str
    #: config sections a run of it never reads (an override of one would change nothing)
    unread_sections: tuple[str, ...]
    summary: SummaryFields

    def budget(self, cfg: MasterConfig) -> int:
        """The run's length: ``<section>.max_num_steps``."""

    def validation_due(self, cfg: MasterConfig, step: int) -> bool:
        """Whether step ``step`` (0: before the first) is validated."""

    def stop_rule(self, cfg: MasterConfig) -> StopRule | None:
        """The early stop of ``cfg``'s runs (None: they run their budget): the driver ends the run
        after the first validated step that reaches it, and that step saves a checkpoint."""

    def retries(self, cfg: MasterConfig) -> Retries:
        """The run's retry settings."""

    def reference_weights(self, cfg: MasterConfig) -> bool:
        """Whether its steps read the reference policy (the initial weights, e.g. a KL term): the
        policy workers keep a copy of them only then."""

    def schedule(self, cfg: MasterConfig) -> Any:
        """The run's :class:`~nrl_tasks.stages.schedule.StepSchedule` (age 0 but for async GRPO)."""

    def facts_options(self, cfg: MasterConfig) -> dict[str, Any]:
        """Keyword arguments of :func:`~nrl_tasks.stages.resume_plan.read_run_facts` for its runs
        (the step's datasets before ``train``, the schedule's lookahead, datasets never made)."""

    def check_config(self, cfg: MasterConfig) -> list[str]:
        """Problems of ``cfg`` for this algorithm (each naming its key); empty when none."""

    def check_recompute(self, specs: Sequence[tuple[str, int]], cfg: MasterConfig) -> None:
        """``ValueError`` for ``--recompute`` items (``(stage, step)``) its config does not allow."""

    def check_data(self, cfg: MasterConfig, layout: RunLayout | None) -> None:
        """``ValueError`` naming the key when the run's data does not read (before anything starts)."""

    def prepare(self, layout: RunLayout, cfg: MasterConfig, tokenizer: Any) -> dict[str, list[dict[str, str]]]:
        """The run's frozen data snapshots (``{"train": [...]}``), taken before Ray starts."""

    def repairs(self, cfg: MasterConfig, layout: RunLayout, window: tuple[int, int], skip: Sequence[tuple[int, str]]) -> tuple[str, ...]:
        """Damaged datasets a resume reads: the URIs the flow deletes and makes again (the same
        bytes), or ``DamagedRunError`` naming what cannot be made again."""

    def inputs(self, ctx: StepContext, version: int, *, overlap: bool = False) -> dict[str, Any]:
        """The step's stages before the policy's (on generation weights ``version``); references
        or futures. ``overlap``: a stage may be submitted to run beside the policy's first."""

    def submit_inputs(self, ctx: StepContext, version: int, after: Any = None) -> dict[str, Any]:
        """:meth:`inputs` of a later step submitted to run beside the policy's stages (async
        GRPO; ``after``: the future it must wait for); references or futures."""

    def update(self, ctx: StepContext, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The policy's stages of the step, ``train`` last: every dataset of the step."""

    def recompute(self, run: RunContext, step: int, generation_version: int) -> None:
        """Make the missing datasets of trained step ``step`` again before its replay (stages
        that find their output committed skip)."""

    def train_once(self, run: RunContext, batches: Mapping[str, Any]) -> dict[str, float]:
        """One update of the policy from the persisted batches of the ``train`` stage's inputs."""

    def validate(self, ctx: StepContext, refit: ActionResult | None) -> DatasetRef:
        """The step's validation (``val`` dataset), after the refit when the recipe has one."""

    def metrics_line(self, ctx: StepContext, refs: StepRefs, wall_seconds: float | None) -> dict[str, Any]:
        """The step's ``metrics.jsonl`` line."""

    def rebuild_line(self, layout: RunLayout, step: int, storage_options: dict[str, Any] | None) -> dict[str, Any]:
        """A lost metrics line of trained step ``step`` from what storage holds."""

    def console_line(self, run_id: str, row: Mapping[str, Any], max_steps: int) -> str:
        """The step's console and log line."""

    def run(self, **params: Any) -> dict[str, Any]:
        """A run of this algorithm: its Prefect flow called with ``params`` (``config``, ``run_id``,
        ``resume``, ``overrides``, ``storage``, ``recompute``, ``take_over``, ``fresh_optimizer``)."""

    def publish_extra(self, ctx: StepContext, refs: StepRefs) -> list[tuple[str, str]]:
        """Extra markdown artifacts of the step (``[(kind, markdown)]``, e.g. GRPO's best and
        worst rollouts), published at checkpoint steps and the last."""

