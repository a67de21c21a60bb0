"""``nrl rm``: reward-model training on preference pairs (Bradley-Terry), as a Prefect flow.

A config with an ``rm`` section (:mod:`nrl_tasks.config.rm`) and
``policy.reward_model_cfg.enabled: true`` is a reward-model run: ``policy.model_name`` loaded as a
one-output sequence classifier (a causal LM's folder, e.g. an SFT run's final checkpoint, gets a
new head) and trained on the pairs DPO reads. Each step (:mod:`nrl_tasks.stages.rm`)::

    pairs = preference_pairs(ctx)          # the recipe's inputs: the step's pairs, tokenised (DPO's stage)
    trained = rm_train(ctx, pairs)         # the recipe's update: one optimizer step (BradleyTerryLossFn)
    checkpoint(ctx, trained)               # every algorithm's end of a step: checkpoint when due,
    rm_validate(ctx)                       #   validation every rm.val_period steps (held-out pair accuracy)

The run around it is every algorithm's (:mod:`flows.algorithms.training`): lease, status and
history, grouped step subflows (the flow ``rm-steps``), the metrics line (loss, accuracy, reward
margin, chosen/rejected rewards, grad norm, stage seconds, ``val_accuracy`` / ``val_loss`` at
validation steps), the summary, trackers, retention, in-run recovery from actor faults and
``--recompute``. Its data half is DPO's (:class:`~flows.algorithms.dpo.DPORecipe`: the frozen
pairs, their checks and repairs). A checkpoint's ``weights`` folder is a Hugging Face
``*ForSequenceClassification`` model: GRPO's ``env.reward_model.model_name`` loads it unchanged.

**Resume**: as DPO's: the policy is restored from the newest sound checkpoint at or before the
trained prefix and the steps after it are replayed from their persisted ``pairs``
(:func:`nrl_tasks.stages.rm.rm_update`), each checked against its recorded weights checksum; the
training draws nothing at random, so the resumed run's weights equal the uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefect.utilities.annotations import quote

from flows.algorithms.dpo import DPORecipe
from flows.algorithms.training import recipe_flow
from flows.config import MasterConfig
from flows.observe.summary import SummaryFields
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.dpo import preference_pairs
from nrl_tasks.stages.rm import RM_GRAPH, RM_TRAIN_KEYS, rm_train, rm_update, rm_validate

__all__ = ["RM", "RMRecipe", "rm"]


class RMRecipe(DPORecipe):
    """Reward-model training as a recipe (see the module docstring)."""

    kind = "rm"
    section = "rm"
    product = "reward_model"
    graph = RM_GRAPH
    unread_sections = ("grpo", "loss_fn", "sft", "dpo", "distillation", "teacher", "ppo", "value", "value_loss_fn")
    summary = SummaryFields(curve="accuracy", curve_label="pair accuracy", eval_metric="val_accuracy",
                            eval_label="held-out pair accuracy")
    train_keys = (*RM_TRAIN_KEYS, "train_seconds")
    update_fn = staticmethod(rm_update)
    validate_task = staticmethod(rm_validate)

    def reference_weights(self, cfg: MasterConfig) -> bool:
        return False  # a reward model is trained alone

    def update(self, ctx: StepContext, inputs: Mapping[str, Any]) -> dict[str, Any]:
        pairs = inputs["pairs"]
        return {"pairs": pairs, "train": rm_train(quote(ctx), pairs)}

    def recompute(self, run: RunContext, step: int, generation_version: int) -> None:
        preference_pairs(quote(run.step(step)))


#: reward-model training's recipe
RM = RMRecipe()

#: the Prefect flow of reward-model runs (a deployment's entrypoint: ``flows/algorithms/rm.py:rm``)
rm = recipe_flow(RM, summary="Train a reward model (Bradley-Terry) on preference pairs (see the module docstring).")
