"""The explicit context of a run and of one step: everything a stage needs, passed in.

The flow (the composition root, :mod:`flows.run.runtime`) builds one :class:`RunContext` per run:
run id, :class:`~nrl_tasks.run_layout.RunLayout`, storage options, config, tokenizer, the run's
actors (an :class:`RunActors`, whose ``policy`` / ``generation`` are typed by the
``PolicyInterface`` / ``GenerationInterface`` Protocols) and the observers of stage events. For each
step it derives a :class:`StepContext` (``run.step(7)``) and hands it to every stage task
explicitly (wrapped in Prefect's ``quote`` so Prefect neither walks nor links it). No stage looks
anything up in a global: the actors a stage calls are the ones on its context, and when the flow's
recovery re-creates an actor it does so on the same :class:`RunActors` object.

Run state lives here too, not in modules: how often each stage of each step ran in this flow
process (the metrics line's ``<stage>_attempts``), which stage failed last (what recovery
re-plans for), and the failed refit attempts of the step in progress.

Observers (:class:`StageObserver`) see each stage start, finish its computation (before the commit)
and commit, and each remote call into an actor group. Production code ships none; tests install a
fault injector through them (``NRL_PLUGINS``, see :mod:`flows.run.plugins`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from nrl_tasks.run_layout import RunLayout
from nrl_tasks.stages.graph import GRPO_GRAPH, StageGraph

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.config.master import MasterConfig
    from nrl_tasks.environments.loading import EnvironmentWorkers
    from nrl_tasks.models.generation.interfaces import GenerationInterface
    from nrl_tasks.models.policy.interfaces import PolicyInterface

__all__ = ["Observers", "RunActors", "RunContext", "StageObserver", "StepContext"]

#: Points of a stage an observer is told about.
STAGE_POINTS = ("start", "computed", "committed")


@runtime_checkable
class StageObserver(Protocol):
    """Told about stage events (all methods optional to act on; exceptions propagate)."""

    def on_stage(self, ctx: StepContext, stage: str, point: str) -> None:
        """``point``: ``start`` (nothing done), ``computed`` (work done, output not committed),
        ``committed`` (output durable, task not returned)."""

    def on_actor_call(self, ctx: StepContext, stage: str, role: str, workers: Sequence[Any]) -> None:
        """Right before ``stage`` calls into the actor group ``role`` (``workers``: handles by rank)."""


class Observers:
    """Fans events out to a list of observers."""

    def __init__(self, observers: Sequence[StageObserver] = ()) -> None:
        self.observers = list(observers)

    def on_stage(self, ctx: StepContext, stage: str, point: str) -> None:
        for o in self.observers:
            o.on_stage(ctx, stage, point)

    def on_actor_call(self, ctx: StepContext, stage: str, role: str, workers: Sequence[Any]) -> None:
        for o in self.observers:
            o.on_actor_call(ctx, stage, role, workers)


class RunActors(Protocol):
    """The run's actor groups and how to (re)create them (implemented in :mod:`flows.run.runtime`)."""

    namespace: str
    #: the handles (``None`` until started; a DPO run has no generation, most runs no reward model)
    policy: PolicyInterface
    generation: GenerationInterface
    reward_model: PolicyInterface | None
    #: on-policy distillation's teacher (``teacher`` section; ``None`` in other runs)
    teacher: PolicyInterface | None
    #: PPO's value model (``None`` in other runs); checkpoints hold it beside the policy
    value: PolicyInterface | None
    #: the multi-turn environment's actors (``env.environment``; ``None`` without one)
    environment: EnvironmentWorkers | None

    def start_policy(self, *, fresh: bool = False) -> bool:
        """Attach to the run's policy actors or create them (``fresh``: always create). True if attached."""

    def start_generation(self, *, fresh: bool = False) -> bool:
        """Attach to the run's generation workers or create them. True if attached."""

    def start_teacher(self, *, fresh: bool = False) -> None:
        """Attach to the run's teacher or create it (``fresh``: kill it and create it)."""

    def start_value(self, *, fresh: bool = False) -> bool:
        """Attach to the run's value model or create it (``fresh``: initial weights). True if attached."""


@dataclass
class RunContext:
    """One run, as the stages see it (built once per run by the flow)."""

    run_id: str
    layout: RunLayout
    cfg: MasterConfig  # the validated run config
    tokenizer: Any
    actors: RunActors
    observers: Observers = field(default_factory=Observers)
    #: the data stages of the run's algorithm (its recipe's)
    graph: StageGraph = GRPO_GRAPH
    #: ``(step, stage) -> times this flow process ran the stage`` (``<stage>_attempts``)
    attempts: dict[tuple[int, str], int] = field(default_factory=dict)
    #: ``(step, stage)`` of the last stage that failed in this process (what recovery re-plans for)
    last_failure: tuple[int, str] | None = None
    #: failed refit attempts per weights version (reported by the refit that succeeds)
    refit_failures: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    #: what the next commit of each stage records about the recovery that preceded it
    #: (``{"recovered": True, "replayed": "1,2"}``; set by the flow's recovery, taken by the stage)
    recovery_notes: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: raises (``storage.lease.LeaseLostError``) once this process may no longer write the run (its
    #: lease was taken over); called before every commit (``None``: no lease, e.g. a test)
    fence: Callable[[], None] | None = None
    _records: dict[str, list[dict[str, str]]] = field(default_factory=dict, repr=False)

    @property
    def storage_options(self) -> dict[str, Any] | None:
        return self.cfg.storage.storage_options or None

    @property
    def storage_kw(self) -> dict[str, Any]:
        """Keyword arguments for ``storage.load_batch`` and friends."""
        opts = self.storage_options
        return {"storage_options": opts} if opts else {}

    @property
    def fsync(self) -> bool:
        return bool(self.cfg.storage.fsync)

    @property
    def policy(self) -> PolicyInterface:
        return self.actors.policy

    @property
    def generation(self) -> GenerationInterface:
        return self.actors.generation

    @property
    def reward_model(self) -> PolicyInterface | None:
        return self.actors.reward_model

    def step(self, step: int) -> StepContext:
        return StepContext(self, int(step))

    def records(self, split: str) -> list[dict[str, str]]:
        """The run's frozen copy of a prompt split (``<run>/data/<split>``), made on first use."""
        if split not in self._records:
            from nrl_tasks.stages.data import snapshot_records

            self._records[split] = snapshot_records(self.layout, self.cfg, split, self.tokenizer, self.storage_options)
        return self._records[split]

    def remember_records(self, split: str, records: list[dict[str, str]]) -> None:
        """Use ``records`` as the snapshot of ``split`` (taken by the flow before Ray started)."""
        self._records[split] = records

    def check_fence(self) -> None:
        """Raise before a commit when this process may no longer write the run (:attr:`fence`)."""
        if self.fence is not None:
            self.fence()

    def count_attempt(self, step: int, stage: str) -> int:
        """Count one more run of ``stage`` for ``step``; returns the attempt number (1, 2, ...)."""
        n = self.attempts.get((step, stage), 0) + 1
        self.attempts[(step, stage)] = n
        return n


class StepContext:
    """One step of a run: what a stage task receives.

    A plain slotted object (not a dataclass): Prefect records it as ``<StepContext>`` when it is
    a flow parameter instead of trying to serialise the run's actors and config.

    ``gen_batch`` (dynamic sampling): the ``prompts``/``generate``/``score`` stages of generation
    batch ``j`` of the step run on ``ctx.gen_batch_ctx(j)``, whose datasets live under
    ``steps/step_N/gen_batches/<j>/`` (:meth:`uri`); ``None`` for the step itself.
    """

    __slots__ = ("gen_batch", "run", "step")

    def __init__(self, run: RunContext, step: int, gen_batch: int | None = None) -> None:
        self.run = run
        self.step = int(step)
        self.gen_batch = None if gen_batch is None else int(gen_batch)

    def __repr__(self) -> str:
        extra = "" if self.gen_batch is None else f", gen_batch={self.gen_batch}"
        return f"StepContext(run_id={self.run.run_id!r}, step={self.step}{extra})"

    @property
    def label(self) -> str:
        """``step7``, or ``step7-gb1`` for generation batch 1 (task run names)."""
        return f"step{self.step}" if self.gen_batch is None else f"step{self.step}-gb{self.gen_batch}"

    def gen_batch_ctx(self, gen_batch: int) -> StepContext:
        """The context of generation batch ``gen_batch`` of this step."""
        return StepContext(self.run, self.step, gen_batch)

    def attempt_key(self, stage: str) -> str:
        """Key of ``stage`` in the run's attempt counts (a generation batch counts apart)."""
        return stage if self.gen_batch is None else f"{stage}@gb{self.gen_batch}"

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def cfg(self) -> MasterConfig:
        return self.run.cfg

    @property
    def layout(self) -> RunLayout:
        return self.run.layout

    @property
    def policy(self) -> PolicyInterface:
        return self.run.policy

    @property
    def generation(self) -> GenerationInterface:
        return self.run.generation

    @property
    def tokenizer(self) -> Any:
        return self.run.tokenizer

    @property
    def storage_kw(self) -> dict[str, Any]:
        return self.run.storage_kw

    def uri(self, dataset: str) -> str:
        """URI of ``dataset`` of this step (of its generation batch, if this is one)."""
        if self.gen_batch is not None:
            return self.run.layout.gen_batch_uri(self.step, self.gen_batch, dataset)
        return self.run.layout.stage_uri(self.step, dataset)

    def at(self, step: int) -> StepContext:
        """The same run at another step."""
        return StepContext(self.run, int(step))

    def emit(self, stage: str, point: str) -> None:
        self.run.observers.on_stage(self, stage, point)

    def actor_call(self, stage: str, role: str, workers: Sequence[Any]) -> None:
        self.run.observers.on_actor_call(self, stage, role, workers)
