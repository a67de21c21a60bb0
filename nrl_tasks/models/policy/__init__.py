"""Policy configuration (NeMo-RL key names) for :class:`~nrl_tasks.models.policy.lm_policy.Policy`.

Units: batch sizes in sequences, ``*_mb_tokens`` in (padded) tokens, learning rates per
optimizer step. Only the keys below are accepted (``extra="forbid"``), so a typo is an error
naming the key instead of a silently ignored setting.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from nrl_tasks.config.base import Section
from nrl_tasks.config.hash import digest
from nrl_tasks.models.generation.interfaces import GenerationConfig
from nrl_tasks.models.policy.schedules import TorchSchedule, from_nemo_rl_list

__all__ = [
    "DTensorConfig",
    "DynamicBatchingConfig",
    "LoRAConfig",
    "OptimizerConfig",
    "OptimizerKwargs",
    "PolicyConfig",
    "RewardModelConfig",
    "SchedulerConfig",
    "SequencePackingConfig",
    "TokenizerConfig",
]

_ADAMW_NAMES = ("torch.optim.AdamW", "AdamW", "adamw")


class TokenizerConfig(Section):
    """``name``: local tokenizer folder (``None``: the model folder)."""

    name: str | None = None
    chat_template: str | None = None


class OptimizerKwargs(Section):
    lr: float = Field(5e-6, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    foreach: bool | None = None

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas must lie in [0, 1), got {v}")
        return v


class OptimizerConfig(Section):
    """AdamW only (``name`` as NeMo-RL spells it: ``torch.optim.AdamW``)."""

    name: str = "torch.optim.AdamW"
    kwargs: OptimizerKwargs = Field(default_factory=OptimizerKwargs)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v not in _ADAMW_NAMES:
            raise ValueError(f"optimizer.name must be one of {_ADAMW_NAMES}, got {v!r}")
        return v


class SchedulerConfig(Section):
    """Learning-rate schedule, stepped once per optimizer step.

    ``warmup_steps`` of linear warm-up (``lr * (step + 1) / warmup_steps``), then ``constant``,
    ``cosine`` (to ``min_lr_ratio * lr`` at ``total_steps``) or ``linear`` decay (same end).
    """

    name: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int | None = Field(None, ge=1)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _check(self) -> "SchedulerConfig":
        if self.name != "constant":
            if self.total_steps is None:
                raise ValueError(f"scheduler.total_steps is required for scheduler.name={self.name!r}")
            if self.total_steps <= self.warmup_steps:
                raise ValueError(
                    f"scheduler.total_steps ({self.total_steps}) must exceed warmup_steps ({self.warmup_steps})"
                )
        return self

    def factor(self, step: int) -> float:
        """LR multiplier after ``step`` optimizer steps (0-based)."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.name == "constant":
            return 1.0
        assert self.total_steps is not None
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        if self.name == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


LORA_A_INITS = ("xavier", "kaiming")


class LoRAConfig(Section):
    """NeMo-RL's ``dtensor_cfg.lora_cfg``: low-rank adapters (``peft``) on the HF policy.

    ``match_all_linear``: every ``nn.Linear`` except the output layer (peft's ``"all-linear"``),
    minus ``exclude_modules``; otherwise exactly ``target_modules`` (module-name suffixes such as
    ``q_proj``), minus ``exclude_modules``. Names (and that something is left to adapt) are checked
    against the model before anything starts, on the meta device from its ``config.json``
    (:func:`~nrl_tasks.models.policy.workers.lora.check_lora_targets`), and again when it is built.
    Scaling is ``alpha / dim`` (no rsLoRA); ``dropout`` applies to the adapter input.
    ``lora_A_init`` (B always starts at zero, so the adapted model starts equal to the base):
    ``"kaiming"`` is peft's ``init_lora_weights=True`` (``kaiming_uniform_(a=sqrt(5))``, which is
    also NeMo's ``kaiming``); ``"xavier"`` (NeMo-RL's default, no peft option) builds with peft's
    default and then redraws A with ``torch.nn.init.xavier_normal_`` from the seeded RNG.
    ``save_merged`` (not a NeMo-RL key): checkpoints also get ``<weights>_merged/``, an HF folder
    with ``W + alpha/dim * B @ A`` that ``from_pretrained`` loads without peft.
    """

    enabled: bool = False
    target_modules: list[str] = Field(default_factory=list)
    exclude_modules: list[str] = Field(default_factory=list)
    match_all_linear: bool = True
    dim: int = Field(8, ge=1, le=1 << 16, description="adapter rank, <= 65536 (wider than any model's layers)")
    alpha: float = Field(32.0, gt=0.0, le=float(1 << 20), description="scaling numerator (scale alpha/dim), <= 2**20")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    lora_A_init: str = "xavier"
    save_merged: bool = False

    @field_validator("lora_A_init")
    @classmethod
    def _init(cls, v: str) -> str:
        if v not in LORA_A_INITS:
            raise ValueError(f"dtensor_cfg.lora_cfg.lora_A_init must be one of {list(LORA_A_INITS)}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _check(self) -> "LoRAConfig":
        if not self.enabled:
            return self
        if self.match_all_linear and self.target_modules:
            raise ValueError(
                "dtensor_cfg.lora_cfg.target_modules must be empty with match_all_linear=true "
                f"(got {self.target_modules}); set match_all_linear=false to pick modules"
            )
        if not self.match_all_linear and not self.target_modules:
            raise ValueError("dtensor_cfg.lora_cfg.target_modules is empty and match_all_linear is false: nothing to adapt")
        return self


class DTensorConfig(Section):
    """NeMo-RL's ``dtensor_cfg``: how torch's FSDP2 lays the policy over its data-parallel ranks
    (:mod:`~nrl_tasks.models.policy.workers.parallel`).

    ``enabled`` (default true, as in NeMo-RL): parameters, gradients and AdamW state sharded
    across the ranks; false: every rank a full copy (FSDP2 with shards of one rank). One rank is a
    plain module either way. ``cpu_offload``: sharded state kept in CPU memory between uses
    (FSDP2's ``CPUOffloadPolicy``). ``activation_checkpointing``: decoder-layer activations
    recomputed in the backward. Not built, refused here: ``tensor_parallel_size`` and
    ``context_parallel_size`` above 1, ``sequence_parallel`` and ``custom_parallel_plan``.
    ``lora_cfg``: see :class:`LoRAConfig` (off by default)."""

    enabled: bool = True
    cpu_offload: bool = False
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    custom_parallel_plan: str | None = None
    lora_cfg: LoRAConfig = Field(default_factory=LoRAConfig)

    @model_validator(mode="after")
    def _check(self) -> "DTensorConfig":
        if self.tensor_parallel_size != 1 or self.context_parallel_size != 1:
            raise ValueError(
                "dtensor_cfg.tensor_parallel_size and context_parallel_size must be 1: only (sharded) data "
                f"parallelism is built, got {self.tensor_parallel_size} and {self.context_parallel_size}"
            )
        if self.sequence_parallel or self.custom_parallel_plan:
            raise ValueError(
                "dtensor_cfg.sequence_parallel and custom_parallel_plan are not supported (they need tensor parallelism)"
            )
        return self


class DynamicBatchingConfig(Section):
    """Micro-batches of at most ``*_mb_tokens`` padded tokens, rows sorted by length."""

    enabled: bool = False
    train_mb_tokens: int | None = Field(None, ge=1)
    logprob_mb_tokens: int | None = Field(None, ge=1)
    sequence_length_round: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "DynamicBatchingConfig":
        if self.enabled and (self.train_mb_tokens is None or self.logprob_mb_tokens is None):
            raise ValueError("dynamic_batching.enabled needs train_mb_tokens and logprob_mb_tokens")
        return self


class SequencePackingConfig(Section):
    """Rows of a bin (at most ``*_mb_tokens`` tokens) run as one packed sequence."""

    enabled: bool = False
    train_mb_tokens: int | None = Field(None, ge=1)
    logprob_mb_tokens: int | None = Field(None, ge=1)
    algorithm: Literal["first_fit_decreasing", "modified_first_fit_decreasing"] = "modified_first_fit_decreasing"
    sequence_length_pad_multiple: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "SequencePackingConfig":
        if self.enabled and (self.train_mb_tokens is None or self.logprob_mb_tokens is None):
            raise ValueError("sequence_packing.enabled needs train_mb_tokens and logprob_mb_tokens")
        return self


class RewardModelConfig(Section):
    """NeMo-RL's ``policy.reward_model_cfg``: ``enabled``, the model is an
    ``AutoModelForSequenceClassification`` with one output, used by ``score``. Which model scores a
    run's rollouts is the run config's ``env.reward_model`` (:class:`nrl_tasks.config.data.RewardModelEnvConfig`).
    ``reward_model_type``: ``bradley_terry`` (a reward model, ``nrl rm``) or ``regression`` (PPO's
    value model: the head at every token, ``value`` section)."""

    enabled: bool = False
    reward_model_type: Literal["bradley_terry", "regression"] = "bradley_terry"


class PolicyConfig(Section):
    """Configuration of a :class:`~nrl_tasks.models.policy.lm_policy.Policy` (NeMo-RL key names).

    ``model_name`` is a local HF folder (nothing is downloaded). ``generation`` (optional) gives
    the sampling temperature that ``get_logprobs`` and ``train`` divide logits by, the settings of
    ``Policy.generate`` and the dtype weights are cast to for a refit. ``num_cpus_per_worker``:
    logical CPUs each worker actor asks for (``None``: its bundle's share);
    ``torch_num_threads``: intra-op threads per worker. ``deterministic``: deterministic torch
    algorithms and seeded RNGs, so resumed training is bit-identical. ``share_prompt_prefix``:
    ``get_logprobs`` and ``train`` run a prompt that several rows of a micro-batch share once and
    the rows' own tokens on its KV cache (same loss and gradient to float32 rounding; padded
    micro-batches of an unwrapped model; see
    :mod:`~nrl_tasks.models.policy.workers.prefix_sharing`).
    """

    model_name: str
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    train_global_batch_size: int = Field(32, ge=1)
    train_micro_batch_size: int = Field(4, ge=1)
    logprob_batch_size: int | None = Field(None, ge=1)
    max_total_sequence_length: int = Field(512, ge=2)
    precision: Literal["float32", "bfloat16"] = "float32"
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: Annotated[
        Annotated[SchedulerConfig, Tag("one")] | Annotated[TorchSchedule, Tag("torch")],
        Discriminator(lambda v: "torch" if (v.get("schedulers") if isinstance(v, dict) else isinstance(v, TorchSchedule)) else "one"),
    ] = Field(
        default_factory=SchedulerConfig, description="one schedule, or NeMo-RL's list of torch schedulers + milestones"
    )
    dtensor_cfg: DTensorConfig = Field(default_factory=DTensorConfig)
    dp_backend: Literal["auto", "gloo", "nccl"] = "auto"
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig)
    generation: GenerationConfig | None = None
    reward_model_cfg: RewardModelConfig = Field(default_factory=RewardModelConfig)
    seed: int = 42
    num_cpus_per_worker: float | None = Field(None, ge=0.0)
    torch_num_threads: int = Field(1, ge=1)
    deterministic: bool = True
    dist_timeout_s: float = Field(600.0, gt=0.0)
    profiler_dir: str | None = None
    share_prompt_prefix: bool = True

    @field_validator("scheduler", mode="before")
    @classmethod
    def _scheduler_list(cls, value: Any) -> Any:
        return from_nemo_rl_list(value)  # NeMo-RL's list form (nrl_tasks.models.policy.schedules)

    @model_validator(mode="after")
    def _check(self) -> "PolicyConfig":
        if self.dynamic_batching.enabled and self.sequence_packing.enabled:
            raise ValueError("dynamic_batching.enabled and sequence_packing.enabled are mutually exclusive")
        if self.train_micro_batch_size > self.train_global_batch_size:
            raise ValueError(
                f"train_micro_batch_size ({self.train_micro_batch_size}) exceeds train_global_batch_size "
                f"({self.train_global_batch_size})"
            )
        if self.dtensor_cfg.lora_cfg.enabled and self.reward_model_cfg.enabled:
            raise ValueError("dtensor_cfg.lora_cfg.enabled is not supported with reward_model_cfg.enabled")
        return self

    @property
    def lora(self) -> LoRAConfig | None:
        """The LoRA settings when LoRA is on, else None."""
        return self.dtensor_cfg.lora_cfg if self.dtensor_cfg.lora_cfg.enabled else None

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer.name or self.model_name

    @property
    def temperature(self) -> float:
        """Logits are divided by this in ``get_logprobs`` and ``train`` (1.0 without generation)."""
        return float(self.generation.temperature) if self.generation is not None else 1.0

    @property
    def effective_logprob_batch_size(self) -> int:
        return self.logprob_batch_size or self.train_micro_batch_size

    @property
    def refit_dtype(self) -> str:
        """Dtype of floating-point weights in a refit: the generation precision, else ours."""
        return self.generation.precision if self.generation is not None else self.precision

    def config_hash(self) -> str:
        """SHA-256 (64 hex chars) of the canonical JSON form: identifies the settings a live policy runs
        (``Policy.attach`` refuses kept actors running others). Not the run's config hash
        (:func:`nrl_tasks.config.hash.config_hash`); both are :func:`~nrl_tasks.config.hash.digest`."""
        data = self.model_dump(mode="json")
        if not self.dtensor_cfg.lora_cfg.enabled:  # hashes as before the key existed
            data["dtensor_cfg"].pop("lora_cfg")
        if self.share_prompt_prefix:  # at its default: hashes as before the key existed
            data.pop("share_prompt_prefix")
        return digest(data)

    def diff(self, other: "PolicyConfig") -> list[str]:
        """Dotted keys whose values differ between ``self`` and ``other``."""
        return sorted(_diff(self.model_dump(mode="json"), other.model_dump(mode="json"), ""))


def _diff(a: Any, b: Any, prefix: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in set(a) | set(b):
            out += _diff(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]
