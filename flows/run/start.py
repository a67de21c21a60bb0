"""One resume entry: the user's intent and the run's facts, checked and planned before anything starts.

:func:`plan_start` is the one place that decides what starting a run will do. The CLI calls it as
a dry run (``nrl resume`` prints the plan, or the reason it is refused, before any Prefect server or
Ray starts); the run session (:mod:`flows.run.session`) calls it under the run's lease, after the
run's ``config.yaml`` was created or its hash checked, and the flow acts on what it returns.

Every algorithm goes through it the same way; what differs is asked of the run's recipe
(:class:`flows.run.recipe.Recipe`). For a run that is continued it:

1. checks the config against the run's saved hash (the refusal names the changed keys) and its
   length against the steps already trained (:func:`check_not_rewound`: a run is never rewound);
2. checks the ``--recompute`` items: names of the recipe's stage graph, allowed by the config
   (``recipe.check_recompute``: GRPO's dynamic sampling) and by the run's resume window
   (:mod:`flows.run.recompute`), and lists the datasets they delete;
3. checks every persisted dataset the resume reads, skipping what is recomputed
   (``recipe.repairs``): GRPO refuses a damaged one naming the ``--recompute`` that repairs it; DPO
   and SFT, whose step inputs are the same bytes whenever made, list the damaged ones the flow
   deletes and makes again (:attr:`StartPlan.rebuild`);
4. reads the run's facts (:func:`~nrl_tasks.stages.resume_plan.read_run_facts`: trained prefix,
   checkpoints, the anchor) and plans the resume for actors that start fresh
   (:func:`~nrl_tasks.stages.resume_plan.plan_resume`): what a resumed flow does when the run's
   actors are gone. The flow then plans again with the actors it finds (live ones on a kept Ray
   may be reused: :func:`flows.run.recovery.recover`);
5. refuses a resume that would train on from a checkpoint holding no optimizer state
   (saved with ``checkpointing.save_optimizer: false``): a fresh optimizer makes the next steps
   differ from an uninterrupted run. ``fresh_optimizer=True`` (``nrl resume RUN --fresh-optimizer``)
   continues anyway; the plan then says so (:attr:`StartPlan.optimizer_reset`) and the flow records
   it in ``status.json`` and in the metrics line of the first step trained after it
   (:func:`check_optimizer_state`).

A new run has nothing to check here (``config.yaml`` is created by the session).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flows.config import ConfigError, MasterConfig
from flows.run.hints import resume_command
from flows.run.recipe import Recipe
from flows.run.recompute import parse_recompute, plan_recompute
from flows.run.state import check_config_hash, trained_prefix
from nrl_tasks.run_layout import RunLayout
from nrl_tasks.stages.checkpoint import has_optimizer_state, read_checkpoint_info
from nrl_tasks.stages.resume_plan import ActorHealth, ResumePlan, RunFacts, plan_resume, read_run_facts

__all__ = ["StartPlan", "check_not_rewound", "check_optimizer_state", "plan_start"]

#: what a resumed flow starts with when its actors are gone: fresh policy and generation workers
FRESH_ACTORS = ActorHealth(policy_version=0, generation_version=0, generation_alive=True, policy_fresh=True)


@dataclass(frozen=True)
class StartPlan:
    """What starting run ``run_id`` will do (see the module docstring)."""

    run_id: str
    algorithm: str
    resume: bool
    #: ``(step, dataset)`` they delete
    deletes: tuple[tuple[int, str], ...] = ()
    facts: RunFacts | None = None
    #: recovery with fresh actors (``None``: a new run, or one whose start deletes data first: the flow plans)
    plan: ResumePlan | None = None
    #: the checkpoint step restored without optimizer state, training on with a fresh optimizer
    #: (``--fresh-optimizer``; ``None``: the optimizer state is restored, or nothing is trained)
    optimizer_reset: int | None = None
    #: damaged datasets the flow deletes before it starts and makes again, the same bytes (DPO, SFT)
    rebuild: tuple[str, ...] = ()

    def refit_generation(self, *, workers_attached: bool) -> bool:
        """Whether the generation workers get a full refit before the first step, whatever
        version they report: when the run is continued (a resume, also a ``prefect flow-run
        retry``, which passes no ``resume``: the run exists) and when the flow attached to workers
        it did not start (a kept Ray)."""
        return self.resume or workers_attached

    def describe(self) -> str:
        if not self.resume:
            return "a new run"
        parts = []
        if self.deletes:
            parts.append("recompute " + ", ".join(f"step {s} {d}" for s, d in self.deletes))
        if self.rebuild:
            parts.append("make again the damaged " + ", ".join(self.rebuild))
        if self.facts is not None:
            parts.append(f"trained steps: {self.facts.last_trained}")
        if self.plan is not None and self.plan.touches_actors:
            parts.append("then " + self.plan.describe() if parts else self.plan.describe())
        if self.optimizer_reset is not None:
            parts.append(f"a fresh optimizer after checkpoint {self.optimizer_reset} (--fresh-optimizer)")
        return "; ".join(parts) or "nothing to recover"


def check_not_rewound(cfg: MasterConfig, layout: RunLayout, recipe: Recipe) -> None:
    """``ConfigError`` when run ``layout.run_id`` has trained more steps than ``cfg`` allows (its
    recipe's budget, ``<section>.max_num_steps``): its committed steps are its history, and a
    shorter budget would write a second, older final checkpoint beside them, not rewind it."""
    key = f"{recipe.section}.max_num_steps"
    budget = recipe.budget(cfg)
    opts = cfg.storage.storage_options or None
    if trained_prefix(layout, budget + 1, opts) <= budget:
        return
    trained = trained_prefix(layout, None, opts)
    raise ConfigError(
        f"{key} = {budget} is below the {trained} steps run {layout.run_id!r} has trained: a run cannot be rewound "
        f"(set {key} >= {trained} to resume or extend it, or start a new run)"
    )


def check_optimizer_state(
    cfg: MasterConfig, layout: RunLayout, restore_from: int | None, *, replay: tuple[int, ...], trains: bool,
    fresh_optimizer: bool,
) -> int | None:
    """The checkpoint step ``restore_from`` when it holds no optimizer state and training follows
    its restore (``replay``: the trained steps replayed on it; ``trains``: steps replayed, or steps
    left below the run's ``max_num_steps``); ``None`` when there is none.

    ``ConfigError`` naming ``checkpointing.save_optimizer`` and ``--fresh-optimizer`` for such a
    checkpoint unless ``fresh_optimizer``: its next steps would silently differ from an
    uninterrupted run's (weights, rollouts, loss). With ``fresh_optimizer`` too when steps were
    trained after the checkpoint: a replay must reproduce their recorded weights, which a fresh
    optimizer cannot (the run refuses there rather than failing after start-up)."""

    step = restore_from
    if not step or not trains:
        return None
    opts = cfg.storage.storage_options or None
    uri = layout.checkpoint_uri(step)
    if has_optimizer_state(uri, read_checkpoint_info(uri, opts), opts):
        return None
    run_id = layout.run_id
    if fresh_optimizer and replay:
        raise ConfigError(
            f"run {run_id!r}: --fresh-optimizer cannot continue from checkpoint {uri} (step {step}): "
            f"{_steps(replay)} trained after it, and replaying must reproduce the recorded weights, "
            "which needs the optimizer state the checkpoint lacks (checkpointing.save_optimizer = false); nothing "
            "was started. Start a new run (its config with checkpointing.save_optimizer: true)"
        )
    if fresh_optimizer:
        return step
    raise ConfigError(
        f"run {run_id!r}: checkpoint {uri} (step {step}) holds no optimizer state (the run has "
        "checkpointing.save_optimizer = false), so training on from it with a fresh optimizer would differ "
        "from an uninterrupted run without saying so; nothing was started. To continue anyway, resume with "
        f"{resume_command(run_id, '--fresh-optimizer')} (recorded as optimizer_reset in status.json and in the "
        "metrics line of the first step trained)"
    )


def _steps(steps: tuple[int, ...]) -> str:
    return f"step {steps[0]} was" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]} were"


def plan_start(
    cfg: MasterConfig, layout: RunLayout, *, recipe: Recipe, resume: bool, recompute: list[str] | None = None,
    fresh_optimizer: bool = False,
) -> StartPlan:
    """Check and plan the start of run ``layout.run_id`` of algorithm ``recipe`` (see the module docstring).

    ``fresh_optimizer``: train on from a checkpoint without optimizer state (refused otherwise).

    ``ConfigError`` / ``ValueError`` / ``DamagedRunError`` with one clear message when it is refused."""
    specs = parse_recompute(recompute, recipe.graph)
    if specs and not resume:
        raise ValueError("recompute needs resume=True")
    if not resume:
        return StartPlan(layout.run_id, recipe.kind, False)
    opts = cfg.storage.storage_options or None
    check_config_hash(layout, cfg)
    check_not_rewound(cfg, layout, recipe)
    recipe.check_recompute(specs, cfg)
    facts_kw = recipe.facts_options(cfg)
    # the anchor, its checkpoint files checked once (the train manifests are read after the
    # damaged-data check, which reports a damaged one plainly)
    window = read_run_facts(layout, opts, verify_checkpoints=True, read_checksums=False, **facts_kw)
    span = (window.anchor, window.last_trained)
    deletes = tuple(plan_recompute(layout, specs, opts, window=span, g=recipe.graph))
    # damaged batches a resume would read: one clear error, or (an algorithm whose step inputs
    # are the same bytes whenever made) the ones the flow deletes and makes again
    rebuild = recipe.repairs(cfg, layout, span, deletes)
    facts = read_run_facts(layout, opts, damaged=window.damaged_checkpoints, **facts_kw)
    gen = recipe.actors.generation  # without generation workers there is nothing to refit
    fresh = FRESH_ACTORS if gen else replace(FRESH_ACTORS, generation_version=facts.last_trained)
    plan = None if deletes or rebuild else plan_resume(facts, fresh, force_refit=gen)  # after deletes: the flow plans
    restores = plan or plan_resume(facts, fresh, force_refit=gen)
    trains = bool(restores.replay) or facts.last_trained < recipe.budget(cfg)
    reset = check_optimizer_state(cfg, layout, restores.restore_from, replay=tuple(restores.replay), trains=trains,
                                  fresh_optimizer=fresh_optimizer)
    return StartPlan(layout.run_id, recipe.kind, True, deletes, facts, plan, optimizer_reset=reset, rebuild=rebuild)
