"""``nrl distill``: on-policy distillation (the student samples, a teacher scores its tokens, the
student trains on the KL to the teacher's top-k distribution), as a Prefect flow.

A config with a ``distillation`` section (:mod:`nrl_tasks.config.distillation`) and a ``teacher``
policy section is a distillation run; ``loss_fn`` holds NeMo-RL's ``kl_type``,
``mixed_kl_weight`` and ``zero_outside_topk`` (:mod:`nrl_tasks.algorithms.distillation`). Each
step (:mod:`nrl_tasks.stages.distill`)::

    prompts, rollouts, rewards = generation lane on weights v = step - 1   (GRPO's stages: the student samples)
    teacher = teacher_topk(rollouts)                                        (the teacher's top-k logits, persisted)
    train = distill_train(rollouts, teacher)                                (one update of the student)
    checkpoint when due || refit to version step; validate when due         (every algorithm's end of a step)

The rewards of the student's samples are computed and logged (``reward_mean``) but not trained
on; validation is GRPO's (held-out greedy accuracy with the task's reward, ``val_accuracy``).
A multi-turn environment (``env.environment``, ``distillation.max_rollout_turns``) works as in
GRPO: the teacher scores the whole episode, the student trains on its own turns' tokens.

**Resume**: as GRPO's: committed stages are skipped; after a restore the ``train`` stages after
the checkpoint are replayed from the persisted ``rollouts`` and ``teacher`` datasets
(:func:`~nrl_tasks.stages.distill.distill_update`), each checked against its recorded weights
checksum, so the teacher is never called again for a committed step. The run is synchronous
(GRPO's async and dynamic-sampling options are refused).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from prefect.utilities.annotations import quote

import storage
from flows.algorithms.epochs import epoch_problems, epoch_steps
from flows.algorithms.grpo import GRPORecipe, train_prompt_count
from flows.algorithms.lanes import generation_lane
from flows.algorithms.training import recipe_flow
from flows.config import MasterConfig
from flows.observe.metrics import build_step_metrics, mark_rebuilt, stored_step
from flows.observe.summary import SummaryFields
from flows.run.recipe import Actors
from nrl_tasks.models.builtin import resolve_model_path
from nrl_tasks.run_layout import RunLayout
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.distill import DISTILL_GRAPH, DISTILL_TRAIN_KEYS, distill_train, distill_update, teacher_topk
from nrl_tasks.stages.refs import StepRefs
from nrl_tasks.stages.schedule import StepSchedule

__all__ = ["DISTILL", "DistillRecipe", "distill"]


class DistillRecipe(GRPORecipe):
    """On-policy distillation as a recipe (see the module docstring): GRPO's sampling, the
    teacher's top k and the distillation update instead of logprobs, advantages and the PG update."""

    kind = "distill"
    section = "distillation"
    graph = DISTILL_GRAPH
    actors = Actors(generation=True, environment=True, teacher=True)
    unread_sections = ("dpo", "sft", "rm", "ppo", "value", "value_loss_fn")
    summary = SummaryFields(curve="kl_reverse", curve_label="reverse KL to the teacher", higher_is_better=False)

    def budget(self, cfg: MasterConfig) -> int:
        d = cfg.distillation
        return epoch_steps(d.max_num_steps, d.max_num_epochs, lambda: train_prompt_count(cfg), d.num_prompts_per_step)

    def validation_due(self, cfg: MasterConfig, step: int) -> bool:
        d = cfg.distillation
        if step == 0:
            return bool(d.val_at_start and d.val_period)
        return bool(d.val_period and step % d.val_period == 0) or (d.val_at_end and step == self.budget(cfg))

    def stop_rule(self, cfg: MasterConfig) -> None:
        return None  # NeMo-RL's distillation has no early stop

    def reference_weights(self, cfg: MasterConfig) -> bool:
        return False  # the teacher's top-k, not a reference policy, is what the update reads

    def schedule(self, cfg: MasterConfig) -> StepSchedule:
        return StepSchedule(self.budget(cfg))

    def facts_options(self, cfg: MasterConfig) -> dict[str, Any]:
        return {"max_steps": self.budget(cfg), "step_inputs": self.graph.step_inputs}

    def check_recompute(self, specs: Sequence[tuple[str, int]], cfg: MasterConfig) -> None:
        return None

    def check_config(self, cfg: MasterConfig) -> list[str]:
        d = cfg.distillation
        return epoch_problems("distillation", d.max_num_epochs, lambda: train_prompt_count(cfg), d.num_prompts_per_step,
                              "distillation.num_prompts_per_step", "prompts")

    def check_data(self, cfg: MasterConfig, layout: RunLayout | None) -> None:
        super().check_data(cfg, layout)
        check_teacher(cfg)

    def inputs(self, ctx: StepContext, version: int, *, overlap: bool = False) -> dict[str, Any]:
        return generation_lane(ctx, version)

    def submit_inputs(self, ctx: StepContext, version: int, after: Any = None) -> dict[str, Any]:
        raise NotImplementedError("distillation runs synchronously")  # the schedule has age 0: never called

    def update(self, ctx: StepContext, inputs: Mapping[str, Any]) -> dict[str, Any]:
        c = quote(ctx)
        rollouts = inputs["rollouts"]
        teacher = teacher_topk(c, rollouts)
        return {**inputs, "teacher": teacher, "train": distill_train(c, rollouts, teacher)}

    def recompute(self, run: RunContext, step: int, generation_version: int) -> None:
        ctx = run.step(step)
        teacher_topk(quote(ctx), generation_lane(ctx, generation_version)["rollouts"])

    def train_once(self, run: RunContext, batches: Mapping[str, Any]) -> dict[str, float]:
        return distill_update(run, batches)

    def metrics_line(self, ctx: StepContext, refs: StepRefs, wall_seconds: float | None) -> dict[str, Any]:
        rw = storage.load_batch(ctx.uri("rewards"), columns=["rewards", "reward_valid"], **ctx.storage_kw)
        manifests = {k: v.summary() for k, v in refs.datasets.items() if v is not None}
        row = build_step_metrics(
            ctx.step, manifests, refit=refs.refit.summary() if refs.refit else None,
            val=refs.val.summary() if refs.val else None, checkpoint=refs.checkpoint.summary() if refs.checkpoint else None,
            wall_seconds=wall_seconds, rewards=(rw["rewards"], rw["reward_valid"]), graph=DISTILL_GRAPH,
        )
        return _with_train_figures(row, manifests)

    def rebuild_line(self, layout: RunLayout, step: int, storage_options: dict[str, Any] | None) -> dict[str, Any]:
        manifests, val, checkpoint = stored_step(layout, step, DISTILL_GRAPH.datasets, storage_options)
        return mark_rebuilt(_with_train_figures(
            build_step_metrics(step, manifests, val=val, checkpoint=checkpoint, graph=DISTILL_GRAPH), manifests))

    def run(self, **params: Any) -> dict[str, Any]:
        return distill(**params)


def check_teacher(cfg: MasterConfig) -> None:
    """``ValueError`` naming ``teacher.model_name`` when the teacher's vocabulary is not the
    student's (its top-k token ids would index other tokens) or its top k is wider than it. A
    model folder that does not exist yet (a pipeline's next stage starts from a checkpoint to
    come) is not compared."""
    from transformers import AutoConfig

    def vocab(name: str) -> int | None:
        path = resolve_model_path(name)
        return int(AutoConfig.from_pretrained(path).vocab_size) if os.path.isdir(path) else None

    student, teacher = vocab(cfg.policy.model_name), vocab(cfg.teacher.model_name)
    if teacher is None:
        return
    if student is not None and student != teacher:
        raise ValueError(f"teacher.model_name {cfg.teacher.model_name!r} has a vocabulary of {teacher} tokens, the student "
                         f"(policy.model_name) {student}: distillation needs the same tokenizer")
    if cfg.distillation.topk_logits_k > teacher:
        raise ValueError(f"distillation.topk_logits_k = {cfg.distillation.topk_logits_k} exceeds the teacher's vocabulary "
                         f"({teacher} tokens)")


def _with_train_figures(row: dict[str, Any], manifests: Mapping[str, Any]) -> dict[str, Any]:
    """A metrics line without GRPO's figures of stages distillation has not, plus the KL figures."""
    for key in ("groups_with_signal", "is_weight_mean", "is_weight_max", "policy_state_mb_per_rank"):
        row.pop(key, None)
    train = manifests.get("train") or {}
    row.update({k: train.get(k) for k in DISTILL_TRAIN_KEYS if k not in ("loss", "grad_norm")})
    return row


#: on-policy distillation's recipe
DISTILL = DistillRecipe()

#: the Prefect flow of distillation runs (a deployment's entrypoint: ``flows/algorithms/distill.py:distill``)
distill = recipe_flow(DISTILL, summary="Distil a teacher into the student on the student's own samples (see the "
                      "module docstring).")
