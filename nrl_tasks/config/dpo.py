"""NeMo-RL's ``dpo`` section: a config with it is a DPO run (``nrl dpo``, :mod:`flows.algorithms.dpo`).

The loss keys are :class:`~nrl_tasks.algorithms.dpo.DPOLossConfig`'s (``reference_policy_kl_penalty``
is beta); the section adds the run's length, seed and NeMo-RL's validation keys. As in NeMo-RL,
``policy.train_global_batch_size`` and ``policy.train_micro_batch_size`` count *pairs* (each pair is
two rows: chosen, rejected). Preference data: ``data.dataset: file`` with ``data.train_path`` a
JSONL/Parquet/Arrow file of ``prompt``, ``chosen``, ``rejected``; or ``data.dataset: arithmetic``,
built-in pairs (chosen: the right answer, rejected: a wrong one).
"""

from __future__ import annotations

from pydantic import Field

from nrl_tasks.algorithms.dpo import DPOLossConfig
from nrl_tasks.config.bounds import INT64, MAX_STEPS
from nrl_tasks.config.sft import SupervisedValidation

__all__ = ["DPOConfig"]


class DPOConfig(DPOLossConfig, SupervisedValidation):
    """NeMo-RL's ``dpo`` keys (see the module docstring); validation: held-out preference
    accuracy and margin (:class:`~nrl_tasks.config.sft.SupervisedValidation`)."""

    max_num_steps: int = Field(20, ge=1, le=MAX_STEPS, description="optimizer steps, <= 10**7")
    max_num_epochs: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="NeMo-RL's key: the run ends after the fewer of max_num_steps and "
        "max_num_epochs * (train pairs // policy.train_global_batch_size) steps (null: max_num_steps alone)",
    )
    seed: int = Field(42, ge=INT64[0], le=INT64[1], description="draw of each step's pairs")
