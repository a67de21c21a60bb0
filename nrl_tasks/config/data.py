"""What a run trains on and how it is scored: the ``data`` and ``env`` sections of the run config."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from nrl_tasks.config.base import Section
from nrl_tasks.config.bounds import MAX_DATASET_ROWS, MAX_SEQUENCE_TOKENS

__all__ = ["GENERATED_DATA_BYTES", "ArithmeticDataConfig", "DataConfig", "EnvConfig", "RewardModelEnvConfig", "generated_record_bytes"]

GENERATED_DATA_BYTES = 4 << 30
"""Memory a generated data set (``data.arithmetic.num_train`` / ``num_val`` records of the built-in
arithmetic, calculator or guess-number task) may take, estimated by :func:`generated_record_bytes`:
4 GiB. ``num_train=1e8`` took about 10 GB in preflight alone; it is refused before anything runs."""


def generated_record_bytes(max_operand: int, few_shot: int) -> int:
    """Estimated bytes one generated record costs while a run holds it: the Python record (a dict
    and two strings, ~250 bytes), its prompt text (``few_shot + 1`` problems of two operands and
    ~24 characters) and, as the preflight check and the snapshot hold it again, three copies of it.

    >>> generated_record_bytes(9, 0)
    828
    """
    problem = 2 * len(str(max_operand)) + 24
    return 3 * (250 + (few_shot + 1) * problem)


class ArithmeticDataConfig(Section):
    """Built-in task generator (``nrl_tasks.environments.arithmetic``)."""

    num_train: int = Field(
        1024, ge=1, le=MAX_DATASET_ROWS, description="size of the train pool (cycled over epochs), <= 10**8"
    )
    num_val: int = Field(64, ge=1, le=MAX_DATASET_ROWS, description="<= 10**8")
    max_operand: int = Field(9, ge=0, le=10**18, description="<= 10**18")
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"], max_length=16)
    few_shot: int = Field(0, ge=0, le=1024, description="solved examples prefixed to every prompt, <= 1024")


class DataConfig(Section):
    #: ``calculator`` / ``guess_number``: the built-in environments' prompts, sized and ranged by
    #: ``data.arithmetic`` (``num_train``, ``num_val``, ``max_operand``; the calculator also ``ops``)
    dataset: Literal["arithmetic", "file", "calculator", "guess_number"] = "arithmetic"
    train_path: str | None = Field(None, description="JSONL/Parquet/Arrow, local or s3://")
    val_path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    prompt_template: str = Field("{prompt}", description="str.format template with {prompt}")
    chat_template: bool = Field(False, description="wrap with the tokenizer's chat template")
    system_prompt: str | None = None
    max_input_seq_length: int | None = Field(
        None, ge=1, le=MAX_SEQUENCE_TOKENS, description="prompt token budget (<= 2**20)"
    )
    overlong_prompts: Literal["truncate", "reject"] = "reject"
    split_validation_size: float = Field(
        0.0, ge=0.0, lt=1.0, description="NeMo-RL's key: this fraction of the train file's rows (rounded up) "
        "held out as the validation split, drawn with split_seed (prompt, SFT and preference files; 0: none)",
    )
    split_seed: int | None = Field(None, description="seed of the held-out draw (null: grpo.seed; DPO: dpo.seed)")
    shuffle: bool = True
    arithmetic: ArithmeticDataConfig = Field(default_factory=ArithmeticDataConfig)

    @model_validator(mode="before")
    @classmethod
    def _path_implies_file(cls, data: Any) -> Any:
        """``data.train_path`` without ``data.dataset`` means the file dataset; with
        ``dataset: arithmetic`` it is a contradiction (the path would be ignored)."""
        if isinstance(data, dict) and data.get("train_path") is not None:
            if "dataset" not in data:
                data = {**data, "dataset": "file"}
            elif data["dataset"] == "arithmetic":
                raise ValueError(
                    "data.train_path is set but data.dataset is 'arithmetic' (the built-in prompts): the file would be "
                    "ignored; set data.dataset: file, or drop data.train_path"
                )
        return data

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.dataset == "file" and not self.train_path:
            raise ValueError("data.train_path is required when data.dataset is 'file'")
        if "{prompt}" not in self.prompt_template:
            raise ValueError("data.prompt_template must contain '{prompt}'")
        if self.dataset != "file":
            self._check_generated_size()
        if self.split_validation_size and (self.dataset != "file" or self.val_path):
            raise ValueError("data.split_validation_size holds rows of data.train_path out: it needs data.dataset 'file' "
                             "and no data.val_path (give one or the other)")
        return self

    def _check_generated_size(self) -> None:
        """Refuse a generated data set larger than :data:`GENERATED_DATA_BYTES`, naming the key."""
        a = self.arithmetic
        per = generated_record_bytes(a.max_operand, a.few_shot)
        for key, num in (("num_train", a.num_train), ("num_val", a.num_val)):
            if num * per > GENERATED_DATA_BYTES:
                raise ValueError(
                    f"data.arithmetic.{key}={num} would take about {num * per / 2**30:.1f} GiB "
                    f"(~{per} bytes per {self.dataset} record with data.arithmetic.few_shot={a.few_shot}, "
                    f"max_operand={a.max_operand}), more than the {GENERATED_DATA_BYTES >> 30} GiB a generated "
                    f"data set may take; use at most data.arithmetic.{key}={GENERATED_DATA_BYTES // per}"
                )


class RewardModelEnvConfig(Section):
    """``env.reward_model``: which sequence-classification model scores the rollouts (NeMo-RL's reward-model
    environment). The flow runs it as a Policy whose ``policy.reward_model_cfg``
    (:class:`~nrl_tasks.models.policy.RewardModelConfig`) is enabled."""

    enabled: bool = False
    model_name: str | None = Field(None, description="local path of a sequence-classification model")


class EnvConfig(Section):
    name: Literal["arithmetic"] = "arithmetic"
    reward_fn: str | None = Field(None, description="'package.module:function' (default: exact match)")
    reward_model: RewardModelEnvConfig = Field(default_factory=RewardModelEnvConfig)
    environment: str | None = Field(
        None, description="a multi-turn environment: a built-in ('calculator', 'guess_number') or "
        "'package.module:ClassName' implementing nrl_tasks.environments.interfaces.EnvironmentInterface",
    )
    environment_kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the environment class")
    num_workers: int = Field(1, ge=1, le=1024, description="Ray actors running the environment, <= 1024")
    step_timeout_s: float | None = Field(
        600.0, gt=0, description="longest wait (s) for one env.environment step() call of the batch; "
        "past it the environment's actors are replaced and the stage fails naming the environment (null: no limit)",
    )

    @model_validator(mode="after")
    def _check(self) -> "EnvConfig":
        if self.reward_fn is not None:
            mod, _, fn = self.reward_fn.partition(":")
            if not mod or not fn or ":" in fn:
                raise ValueError(f"env.reward_fn must look like 'package.module:function', got {self.reward_fn!r}")
        if self.environment is not None and (self.reward_fn is not None or self.reward_model.enabled):
            raise ValueError("env.environment rewards the episodes itself: drop env.reward_fn / env.reward_model.enabled")
        if self.reward_model.enabled:
            if self.reward_fn is not None:
                raise ValueError("env.reward_fn and env.reward_model.enabled are mutually exclusive")
            if not self.reward_model.model_name:
                raise ValueError("env.reward_model.model_name is required when env.reward_model.enabled")
        return self
