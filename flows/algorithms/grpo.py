"""GRPO: generate → score → logprob → advantages → train → refit, step after step (``nrl grpo``).

Its recipe (:data:`GRPO`, :class:`flows.run.recipe.Recipe`) is the algorithm; the run around it
(lease, status, recovery, the step driver, publishing, trackers, retention) is every algorithm's
(:mod:`flows.algorithms.training`). A step (:mod:`flows.algorithms.lanes`)::

    prompts, rollouts, rewards = generation lane on weights v = step - 1   (the recipe's inputs)
    logprobs, advantages, train = policy lane                               (the recipe's update)
    checkpoint when due || refit to version step; validate when due         (every algorithm's end of a step)

Every stage persists its output under ``<storage>/<run_id>/steps/step_N/`` and is idempotent, so a
resumed flow (``resume=True``, ``nrl resume RUN_ID`` or ``prefect flow-run retry``) recomputes
nothing that is committed. When the Policy actors are gone (a local Ray dies with the flow
process) or hold other weights than the run's trained prefix, the last checkpoint is restored and
the ``train`` stages after it are *replayed* from their persisted batches (no regeneration). Every
resume then starts the generation side with a full refit.

With ``grpo.async_grpo.enabled`` the generation of later steps overlaps the policy's work, on
weights versions fixed by the step (:mod:`flows.algorithms.driver`). With ``warm_start.sft_steps``
the run first trains an SFT run ``<run_id>-sft`` and starts from its weights
(:mod:`flows.algorithms.warm_start`).

Per step: one line in ``metrics.jsonl`` (:func:`flows.observe.metrics.build_step_metrics`), the
run summary, progress and metrics-table artifacts, the best and worst rollouts at checkpoint steps
and the last (bounded: :mod:`flows.observe.artifacts`), one INFO log line and a console line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect.utilities.annotations import quote

import storage
from flows.algorithms.lanes import data_stages, generation_lane, policy_lane, submit_generation
from flows.algorithms.training import recipe_flow
from flows.algorithms.warm_start import ensure_warm_start, with_warm_start_weights
from flows.config import MasterConfig
from flows.observe.artifacts import rollouts_markdown
from flows.observe.metrics import build_step_metrics, format_console_line, rebuild_step_metrics
from flows.observe.summary import GRPO_FIELDS
from flows.run.preflight import check_prompt_files
from flows.algorithms.epochs import epoch_problems, epoch_steps, train_row_count
from flows.run.recipe import Actors, Retries, StopRule
from flows.run.recompute import check_resume_data
from nrl_tasks.run_layout import RunLayout
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.data import load_prompt_records, snapshot_records
from nrl_tasks.stages.evaluate import validate
from nrl_tasks.stages.graph import GRPO_GRAPH
from nrl_tasks.stages.logprob import reference_needed
from nrl_tasks.stages.refs import ActionResult, DatasetRef, StepRefs
from nrl_tasks.stages.resume_plan import grpo_facts_options
from nrl_tasks.stages.schedule import StepSchedule
from nrl_tasks.stages.train import grpo_update

__all__ = ["GRPO", "GRPORecipe", "check_recompute_config", "grpo"]

#: ``--recompute`` names refused with ``grpo.use_dynamic_sampling``: which groups a step trains on
#: depends on its rewards, so these would need the step's generation batches recomputed too
SAMPLED_NAMES = ("prompts", "generate", "rollouts", "score", "rewards")


def check_recompute_config(specs: Sequence[tuple[str, int]], cfg: MasterConfig) -> None:
    """``ValueError`` for ``--recompute`` items the run's config does not allow (dynamic sampling:
    :data:`SAMPLED_NAMES`)."""
    if not cfg.grpo.use_dynamic_sampling:
        return
    bad = [f"{stage}@{step}" for stage, step in specs if stage in SAMPLED_NAMES]
    if bad:
        raise ValueError(
            f"--recompute {', '.join(bad)}: with grpo.use_dynamic_sampling a step's prompts, rollouts and rewards "
            "are chosen from its generation batches by their rewards; only logprobs, advantages, train and val can "
            "be recomputed"
        )


class GRPORecipe:
    """GRPO as a recipe (see the module docstring)."""

    kind = "grpo"
    section = "grpo"
    graph = GRPO_GRAPH
    actors = Actors(generation=True, reward_model=True, environment=True)
    product = "policy"
    unread_sections = ("dpo", "sft", "rm", "distillation", "teacher", "ppo", "value", "value_loss_fn")
    summary = GRPO_FIELDS

    def budget(self, cfg: MasterConfig) -> int:
        """``grpo.max_num_steps``, or fewer: ``max_num_epochs`` passes over the train prompts (NeMo-RL's
        ``max_num_epochs * len(dataloader)``, the dataloader dropping a last partial batch)."""
        g = cfg.grpo
        return epoch_steps(g.max_num_steps, g.max_num_epochs, lambda: train_prompt_count(cfg), g.num_prompts_per_step)

    def validation_due(self, cfg: MasterConfig, step: int) -> bool:
        g = cfg.grpo
        if step == 0:
            return bool(g.val_at_start and g.val_period)
        return bool(g.val_period and step % g.val_period == 0) or (g.val_at_end and step == self.budget(cfg))

    def stop_rule(self, cfg: MasterConfig) -> StopRule | None:
        g = cfg.grpo
        if g.stop_at_validation_metric is None or g.stop_at_validation_threshold is None:
            return None
        return StopRule(f"val_{g.stop_at_validation_metric}", g.stop_at_validation_threshold, "grpo.stop_at_validation_metric")

    def reference_weights(self, cfg: MasterConfig) -> bool:
        return reference_needed(cfg)  # the logprob stage's KL reference (PPO's too)

    def retries(self, cfg: MasterConfig) -> Retries:
        g = cfg.grpo
        return Retries(g.stage_retries, tuple(g.stage_retry_delay_s), g.refit.retries, tuple(g.refit.retry_delay_s))

    def schedule(self, cfg: MasterConfig) -> StepSchedule:
        return StepSchedule.from_config(cfg)

    def facts_options(self, cfg: MasterConfig) -> dict[str, Any]:
        return grpo_facts_options(cfg)

    def check_recompute(self, specs: Sequence[tuple[str, int]], cfg: MasterConfig) -> None:
        check_recompute_config(specs, cfg)

    def check_config(self, cfg: MasterConfig) -> list[str]:
        g = cfg.grpo
        return epoch_problems("grpo", g.max_num_epochs, lambda: train_prompt_count(cfg), g.num_prompts_per_step,
                              "grpo.num_prompts_per_step", "prompts")

    def check_data(self, cfg: MasterConfig, layout: RunLayout | None) -> None:
        check_prompt_files(cfg)

    def prepare(self, layout: RunLayout, cfg: MasterConfig, tokenizer: Any) -> dict[str, list[dict[str, str]]]:
        return {"train": snapshot_records(layout, cfg, "train", tokenizer, cfg.storage.storage_options or None)}

    def repairs(self, cfg: MasterConfig, layout: RunLayout, window: tuple[int, int], skip: Sequence[tuple[int, str]]) -> tuple[str, ...]:
        check_resume_data(layout, cfg.storage.storage_options or None, skip=skip, window=window)
        return ()

    def inputs(self, ctx: StepContext, version: int, *, overlap: bool = False) -> dict[str, Any]:
        return generation_lane(ctx, version, overlap_score=overlap)

    def submit_inputs(self, ctx: StepContext, version: int, after: Any = None) -> dict[str, Any]:
        return submit_generation(ctx, version, after)

    def update(self, ctx: StepContext, inputs: Mapping[str, Any]) -> dict[str, Any]:
        return policy_lane(ctx, dict(inputs))

    def recompute(self, run: RunContext, step: int, generation_version: int) -> None:
        data_stages(run.step(step), step - 1, generation_version=generation_version)

    def train_once(self, run: RunContext, batches: Mapping[str, Any]) -> dict[str, float]:
        return grpo_update(run, batches)

    def validate(self, ctx: StepContext, refit: ActionResult | None) -> DatasetRef:
        return validate(quote(ctx), refit, ctx.step)

    def metrics_line(self, ctx: StepContext, refs: StepRefs, wall_seconds: float | None) -> dict[str, Any]:
        rw = storage.load_batch(ctx.uri("rewards"), columns=["rewards", "reward_valid"], **ctx.storage_kw)
        row = build_step_metrics(
            ctx.step, {k: v.summary() for k, v in refs.datasets.items() if v is not None},
            refit=refs.refit.summary() if refs.refit else None, val=refs.val.summary() if refs.val else None,
            checkpoint=refs.checkpoint.summary() if refs.checkpoint else None,
            wall_seconds=wall_seconds, rewards=(rw["rewards"], rw["reward_valid"]),
        )
        if refs.datasets.get("logprobs", True) is None:
            row["logprob_skipped"] = True  # nothing reads them (loss_fn.force_on_policy_ratio, no KL)
        return row

    def rebuild_line(self, layout: RunLayout, step: int, storage_options: dict[str, Any] | None) -> dict[str, Any]:
        return rebuild_step_metrics(layout, step, storage_options)

    def console_line(self, run_id: str, row: Mapping[str, Any], max_steps: int) -> str:
        return format_console_line(run_id, row, max_steps)

    def run(self, **params: Any) -> dict[str, Any]:
        """A run of this recipe: its Prefect flow :func:`grpo` called with ``params``."""
        return grpo(**params)

    def publish_extra(self, ctx: StepContext, refs: StepRefs) -> list[tuple[str, str]]:
        """The step's best and worst rollouts (whole episodes with a multi-turn environment)."""
        n = ctx.cfg.logger.num_rollouts_to_show
        if n <= 0:
            return []
        convo = ctx.cfg.env.environment is not None
        cols = ["prompt", "response", "answer", *(["message_log"] if convo else [])]
        r = storage.load_batch(ctx.uri("rollouts"), columns=cols, **ctx.storage_kw)
        rw = storage.load_batch(ctx.uri("rewards"), columns=["rewards"], **ctx.storage_kw)
        md = rollouts_markdown(ctx.run_id, ctx.step, r["prompt"], r["response"], r["answer"], rw["rewards"].tolist(), n=n,
                               conversations=r["message_log"] if convo else None)
        return [("rollouts", md)]


def train_prompt_count(cfg: MasterConfig) -> int:
    """Rows of the run's train split (``grpo.max_num_epochs``)."""
    return train_row_count(load_prompt_records, cfg, cfg.rollout.seed)


#: GRPO's recipe
GRPO = GRPORecipe()


#: the Prefect flow of GRPO runs (a deployment's entrypoint: ``flows/algorithms/grpo.py:grpo``)
grpo = recipe_flow(GRPO, summary="Train with GRPO (see the module docstring).",
                   configure=ensure_warm_start,  # warm_start.sft_steps: an SFT run first
                   saved_form=with_warm_start_weights)
