"""``nrl dpo``: Direct Preference Optimization on preference pairs, as a Prefect flow.

A config with a ``dpo`` section (:mod:`nrl_tasks.config.dpo`) is a DPO run. Each step
(:mod:`nrl_tasks.stages.dpo`)::

    pairs = preference_pairs(ctx)                  # the recipe's inputs: the step's pairs, tokenised
    reference = reference_logprobs(ctx, pairs)     # the recipe's update: the frozen reference's logprobs,
    trained = dpo_train(ctx, pairs, reference)     #   then one optimizer step (DPOLossFn)
    checkpoint(ctx, trained)                       # every algorithm's end of a step: checkpoint when due,
    dpo_validate(ctx)                              #   validation every dpo.val_period steps (held-out pairs)

The run around it is every algorithm's (:mod:`flows.algorithms.training`): the lease, status and
history, grouped step subflows (``<run_id>-steps-0001-0010``, the flow ``dpo-steps``), the
metrics line (loss, accuracy, reward margin, chosen/rejected rewards, grad norm, stage seconds,
``val_loss``/``val_accuracy``/``val_rewards_margin_mean`` at validation steps), the summary with its
plot (pair accuracy per step, held-out accuracy) and history, the trackers, retention, in-run
recovery from actor faults (the stages on the policy are retried after the recovery restores its
weights) and ``--recompute``.

**Resume**: the trained prefix ``T`` is the last step before the first one without a committed
``train``; the anchor is the newest checkpoint at or before ``T`` whose files check out (else the
initial weights). The policy is restored from the anchor and steps ``anchor+1 .. T`` are replayed
from their persisted ``pairs`` and ``reference`` (:func:`nrl_tasks.stages.dpo.dpo_update`), each
checked against its recorded weights checksum. DPO draws nothing at random, so the resumed run's
weights equal the uninterrupted run's bit for bit. Damaged datasets the resume reads are deleted
and made again (the same bytes); a damaged ``train`` stops the resume with the file named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect.utilities.annotations import quote

import storage
from flows.algorithms import supervised
from flows.algorithms.supervised import SupervisedRecipe
from flows.algorithms.training import recipe_flow
from flows.config import MasterConfig
from flows.observe.summary import SummaryFields
from nrl_tasks.run_layout import RunLayout
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.dpo import DPO_GRAPH, dpo_train, dpo_update, dpo_validate, preference_pairs, reference_logprobs
from nrl_tasks.stages.preferences import (
    load_preferences, pairs_seed, snapshot_preferences, snapshot_repair, snapshot_uri, source_preferences,
)

__all__ = ["DPO", "DPORecipe", "TRAIN_KEYS", "dpo"]

#: ``train`` figures in the metrics line
TRAIN_KEYS = ("loss", "accuracy", "rewards_margin_mean", "rewards_chosen_mean", "rewards_rejected_mean",
              "preference_loss", "sft_loss", "grad_norm", "train_seconds")


class DPORecipe(SupervisedRecipe):
    """DPO as a recipe (see the module docstring). Its data half (the frozen preference pairs,
    their checks and repairs, the step's ``pairs``) is also reward-model training's
    (:class:`flows.algorithms.rm.RMRecipe` subclasses it), so it reads the run's own section."""

    kind = "dpo"
    section = "dpo"
    graph = DPO_GRAPH
    unread_sections = ("grpo", "loss_fn", "sft", "rm", "distillation", "teacher", "ppo", "value", "value_loss_fn")
    summary = SummaryFields(curve="accuracy", curve_label="pair accuracy", eval_metric="val_accuracy",
                            eval_label="held-out pair accuracy")
    train_keys = TRAIN_KEYS
    update_fn = staticmethod(dpo_update)
    validate_task = staticmethod(dpo_validate)
    row_loader = staticmethod(load_preferences)

    def reference_weights(self, cfg: MasterConfig) -> bool:
        return True  # the frozen reference's logprobs of every pair
    console_figures = (("loss", "loss", ".4f"), ("accuracy", "accuracy", ".3f"), ("margin", "rewards_margin_mean", ".4f"))

    def check_config(self, cfg: MasterConfig) -> list[str]:
        problems = []
        section = self._section(cfg)
        if section is not None and section.validates and cfg.data.dataset == "file" and not (
                cfg.data.val_path or cfg.data.split_validation_size):
            problems.append(f"{self.section}.val_period = {section.val_period} (or {self.section}.val_at_end) needs "
                            "held-out pairs: set data.val_path (a preference file) or data.split_validation_size")
        return problems + self.epoch_problems(cfg)

    def row_seed(self, cfg: MasterConfig) -> int:
        return pairs_seed(cfg)

    def check_data(self, cfg: MasterConfig, layout: RunLayout | None) -> None:
        """The pairs a run would freeze read (a resume reads its frozen copy: not checked again)."""
        opts = cfg.storage.storage_options or None
        splits = ["train"] + (["val"] if self._section(cfg).validates else [])
        for split in splits:
            if layout is not None and supervised_snapshot_committed(layout, split, opts):
                continue
            try:
                source_preferences(cfg, opts, split)
            except (OSError, ValueError) as exc:
                raise ValueError(f"{f'data.{split}_path' if cfg.data.dataset == 'file' else 'data.arithmetic'}: {exc}") from None

    def prepare(self, layout: RunLayout, cfg: MasterConfig, tokenizer: Any) -> dict[str, list[dict[str, str]]]:
        opts = cfg.storage.storage_options or None
        out = {"preferences": snapshot_preferences(layout, cfg, opts)}
        if self._section(cfg).validates:
            out["preferences_val"] = snapshot_preferences(layout, cfg, opts, "val")
        return out

    def repairs(self, cfg: MasterConfig, layout: RunLayout, window: tuple[int, int], skip: Sequence[tuple[int, str]]) -> tuple[str, ...]:
        snapshot = snapshot_repair(layout, cfg, cfg.storage.storage_options or None)
        return supervised.repairs(layout, cfg, self.graph, window, skip, snapshot)

    def inputs(self, ctx: StepContext, version: int, *, overlap: bool = False) -> dict[str, Any]:
        return {"pairs": preference_pairs(quote(ctx))}

    def update(self, ctx: StepContext, inputs: Mapping[str, Any]) -> dict[str, Any]:
        c, pairs = quote(ctx), inputs["pairs"]
        reference = reference_logprobs(c, pairs)
        return {"pairs": pairs, "reference": reference, "train": dpo_train(c, pairs, reference)}

    def recompute(self, run: RunContext, step: int, generation_version: int) -> None:
        c = quote(run.step(step))
        reference_logprobs(c, preference_pairs(c))



def supervised_snapshot_committed(layout: RunLayout, split: str, opts: dict[str, Any] | None) -> bool:
    """Whether the run's frozen pairs of ``split`` are committed (a resume reads them, not the source)."""
    return storage.is_committed(snapshot_uri(layout, split), **({"storage_options": opts} if opts else {}))


#: DPO's recipe
DPO = DPORecipe()


#: the Prefect flow of DPO runs (a deployment's entrypoint: ``flows/algorithms/dpo.py:dpo``)
dpo = recipe_flow(DPO, summary="Train with DPO (see the module docstring).")
