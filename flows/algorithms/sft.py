"""``nrl sft``: supervised fine-tuning on demonstrations, as a Prefect flow.

A config with an ``sft`` section (NeMo-RL's keys: :mod:`nrl_tasks.config.sft`) is an SFT run. Each
step (:mod:`nrl_tasks.stages.sft`)::

    batch = sft_batch(ctx)              # the recipe's inputs: the step's rows, tokenised (assistant turns in the loss)
    trained = sft_train(ctx, batch)     # the recipe's update: one optimizer step (NLLLossFn)
    checkpoint(ctx, trained)            # every algorithm's end of a step: checkpoint when due,
    sft_validate(ctx)                   #   held-out loss every sft.val_period steps

Data: NeMo-RL's chat rows (``messages``), (prompt, answer) pairs, or the built-in task's prompts
and reference answers (its rows drawn with ``grpo.seed``, like a GRPO run's prompts, so an SFT
warm start trains on its GRPO run's task). The run around it is every algorithm's
(:mod:`flows.algorithms.training`): lease, status and history, grouped subflows (the flow
``sft-steps``), metrics line (loss, grad norm, tokens/s, ``val_loss``), summary (loss per step,
held-out loss), trackers, retention, in-run recovery, ``--recompute`` and a bit-identical resume
(the batches drawn again are the same bytes; a replay from the persisted ``batch`` must reproduce
each step's recorded weights checksum). Its checkpoints' ``weights`` folders load as
``policy.model_name`` of a later run (the post-training pipeline's next stage; GRPO's warm start,
:mod:`flows.algorithms.warm_start`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect.utilities.annotations import quote

from flows.algorithms import supervised
from flows.algorithms.supervised import SupervisedRecipe
from flows.algorithms.training import recipe_flow
from flows.config import MasterConfig
from flows.observe.summary import SummaryFields
from nrl_tasks.run_layout import RunLayout
from nrl_tasks.stages.context import RunContext, StepContext
from nrl_tasks.stages.data import snapshot_records
from nrl_tasks.stages.sft import SFT_GRAPH, build_sft_batch, load_sft_records, sft_batch, sft_train, sft_update, sft_validate

__all__ = ["SFT", "SFTRecipe", "TRAIN_KEYS", "build_sft_batch", "sft"]

#: ``train`` figures in the metrics line
TRAIN_KEYS = ("loss", "grad_norm", "tokens_per_s", "train_seconds")


class SFTRecipe(SupervisedRecipe):
    """SFT as a recipe (see the module docstring)."""

    kind = "sft"
    section = "sft"
    graph = SFT_GRAPH
    unread_sections = ("loss_fn", "dpo", "rm", "distillation", "teacher", "ppo", "value", "value_loss_fn")
    summary = SummaryFields(curve="loss", curve_label="loss", eval_metric="val_loss", eval_label="held-out loss",
                            higher_is_better=False)
    train_keys = TRAIN_KEYS
    update_fn = staticmethod(sft_update)
    validate_task = staticmethod(sft_validate)
    row_loader = staticmethod(load_sft_records)
    console_figures = (("loss", "loss", ".4f"), ("grad_norm", "grad_norm", ".3f"))

    def check_config(self, cfg: MasterConfig) -> list[str]:
        problems = []
        if cfg.sft.validates and cfg.data.dataset == "file" and not (cfg.data.val_path or cfg.data.split_validation_size):
            problems.append(f"sft.val_period = {cfg.sft.val_period} (or sft.val_at_end) needs held-out rows: "
                            "set data.val_path (an SFT file) or data.split_validation_size")
        return problems + self.epoch_problems(cfg)

    def row_seed(self, cfg: MasterConfig) -> int:
        return cfg.grpo.seed

    def check_data(self, cfg: MasterConfig, layout: RunLayout | None) -> None:
        opts = cfg.storage.storage_options or None
        for split in ["train"] + (["val"] if cfg.sft.validates else []):
            try:
                load_sft_records(cfg.data, split, cfg.grpo.seed, opts)
            except (OSError, ValueError) as exc:
                raise ValueError(f"{f'data.{split}_path' if cfg.data.dataset == 'file' else 'data.arithmetic'}: {exc}") from None

    def prepare(self, layout: RunLayout, cfg: MasterConfig, tokenizer: Any) -> dict[str, list[dict[str, str]]]:
        opts = cfg.storage.storage_options or None
        splits = ["train"] + (["val"] if cfg.sft.validates else [])
        return {split: snapshot_records(layout, cfg, split, None, opts, load=load_sft_records) for split in splits}

    def repairs(self, cfg: MasterConfig, layout: RunLayout, window: tuple[int, int], skip: Sequence[tuple[int, str]]) -> tuple[str, ...]:
        return supervised.repairs(layout, cfg, SFT_GRAPH, window, skip, None)

    def inputs(self, ctx: StepContext, version: int, *, overlap: bool = False) -> dict[str, Any]:
        return {"batch": sft_batch(quote(ctx))}

    def update(self, ctx: StepContext, inputs: Mapping[str, Any]) -> dict[str, Any]:
        return {"batch": inputs["batch"], "train": sft_train(quote(ctx), inputs["batch"])}

    def recompute(self, run: RunContext, step: int, generation_version: int) -> None:
        sft_batch(quote(run.step(step)))



#: SFT's recipe
SFT = SFTRecipe()


#: the Prefect flow of SFT runs (a deployment's entrypoint: ``flows/algorithms/sft.py:sft``)
sft = recipe_flow(SFT, summary="Train with SFT (see the module docstring); the last checkpoint's ``weights`` folder "
                             "loads as ``policy.model_name`` of a later run.")
