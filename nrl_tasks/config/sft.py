"""NeMo-RL's ``sft`` section: a config with it is an SFT run (``nrl sft``, :mod:`flows.algorithms.sft`).

The keys are NeMo-RL's (``examples/configs/sft.yaml``): the run's length, the validation cadence
and size, the seed of the draw. The validation keys are shared with the ``dpo`` section
(:class:`SupervisedValidation`): ``val_period`` steps between validations (0: none),
``val_batches`` batches of ``val_global_batch_size`` held-out rows (pairs for DPO) each, computed
``val_micro_batch_size`` at a time, ``val_at_start`` also before the first step, ``val_at_end``
also after the last step (the run's budget: ``max_num_steps`` or the ``max_num_epochs`` bound).

Data: ``data.train_path`` (JSONL, Parquet or Arrow) with NeMo-RL's chat rows
(``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}``, the
loss on the assistant turns only) or (``data.prompt_key``, ``data.answer_key``) pairs; without a
file, the built-in task's prompts and reference answers. The held-out rows are ``data.val_path``
or the built-in task's validation split.
"""

from __future__ import annotations

from pydantic import Field

from nrl_tasks.config.base import Section
from nrl_tasks.config.bounds import INT64, MAX_STEPS

__all__ = ["SFTConfig", "SupervisedValidation"]


class SupervisedValidation(Section):
    """NeMo-RL's validation keys of the ``sft`` and ``dpo`` sections."""

    val_period: int = Field(0, ge=0, le=MAX_STEPS, description="steps between validations (0: none)")
    val_batches: int = Field(1, ge=1, le=10_000, description="held-out batches per validation")
    val_global_batch_size: int = Field(8, ge=1, le=65_536, description="held-out rows (DPO: pairs) per batch")
    val_micro_batch_size: int = Field(1, ge=1, le=65_536, description="rows (DPO: pairs) computed at a time")
    val_at_start: bool = Field(False, description="validate the initial weights too (step 0)")
    val_at_end: bool = Field(False, description="validate after the run's last step too (NeMo-RL's key)")

    @property
    def validates(self) -> bool:
        """Whether the run reads held-out rows: ``val_period`` > 0 or ``val_at_end``."""
        return bool(self.val_period or self.val_at_end)

    @property
    def val_rows(self) -> int:
        """Held-out rows one validation reads: ``val_batches * val_global_batch_size``."""
        return self.val_batches * self.val_global_batch_size


class SFTConfig(SupervisedValidation):
    """NeMo-RL's ``sft`` keys (see the module docstring)."""

    max_num_steps: int = Field(60, ge=1, le=MAX_STEPS, description="optimizer steps, <= 10**7")
    max_num_epochs: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="NeMo-RL's key: the run ends after the fewer of max_num_steps and "
        "max_num_epochs * (train rows // policy.train_global_batch_size) steps (null: max_num_steps alone)"
    )
    seed: int = Field(42, ge=INT64[0], le=INT64[1], description="draw of each step's rows")
