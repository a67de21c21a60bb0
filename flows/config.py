"""The run configuration: YAML + dotted overrides, validated by pydantic before anything starts.

Keys keep NeMo-RL's names where they exist (``grpo.num_prompts_per_step``,
``grpo.num_generations_per_prompt``, ``grpo.max_num_steps``, ``grpo.val_period``,
``checkpointing.save_period``, ``policy.model_name``, ``policy.train_global_batch_size``,
``loss_fn.reference_policy_kl_penalty``, ...). Every section forbids unknown keys; all problems
found are reported together in one :class:`ConfigError` (a ``ValueError``). Numbers are finite,
booleans are not numbers and sizes have maxima a real run stays far below (:mod:`flows.config_bounds`);
YAML is read by one bounded loader that refuses repeated keys (:mod:`flows.config_io`).

The *config hash* (:mod:`flows.config_hash`) covers everything that changes the numbers a run produces; it leaves out
where things run and are written (``cluster.ray``, ``storage``), how they are shown
(``logger``), the length of the run (``grpo.max_num_steps``, so a finished run can be extended),
retry settings (``grpo.refit``, ``grpo.stage_retries``, ``grpo.stage_retry_delay_s``) and the
checkpoint cadence/retention. Resuming with a different hash is refused.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flows.config_advantages import AdvEstimatorConfig
from flows.config_async import AsyncGRPOConfig
from flows.config_bounds import (  # the maxima, named (``le=`` below) and checked by ``value_errors``
    INT64, MAX_DATASET_ROWS, MAX_PROMPTS, MAX_RETRIES, MAX_ROWS, MAX_SECONDS, MAX_SEQUENCE_TOKENS, MAX_STEPS,
    MAX_WORKERS, check_delays, value_errors,
)
from flows.config_combinations import combination_errors
from flows.config_dpo import DPOConfig
from flows.config_io import ConfigError, load_yaml_file, load_yaml_text
from flows.config_logger import LoggerConfig, MLflowConfig, WandbConfig
from flows.config_secrets import credential_paths, redact
from flows.overrides import apply_overrides
from nrl_tasks.algorithms.loss_functions import ClippedPGLossConfig
from nrl_tasks.algorithms.reward_shaping import RewardShapingConfig
from nrl_tasks.models.generation.interfaces import GenerationConfig
from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.stages.errors import DEFAULT_STAGE_RETRIES, DEFAULT_STAGE_RETRY_DELAY_S

__all__ = [
    "CheckpointingConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "GRPOConfig",
    "LoggerConfig",
    "MLflowConfig",
    "MasterConfig",
    "RayConfig",
    "RefitConfig",
    "StorageConfig",
    "StorageRetryConfig",
    "WandbConfig",
    "changed_keys",
    "config_hash",
    "config_to_yaml",
    "credential_paths",
    "hashed_data",
    "load_config",
    "load_config_dict",
    "load_config_text",
    "redact",
    "saved_config_hash",
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RefitConfig(_Section):
    """How weights move from the Policy to the generation workers after each ``train``."""

    timeout_s: float = Field(
        120.0, gt=0, le=MAX_SECONDS, description="hard deadline of one refit attempt (s, <= 1 day)"
    )
    retries: int = Field(3, ge=0, le=MAX_RETRIES, description="Prefect retries of the refit task (<= 100)")
    retry_delay_s: list[float] = Field(default_factory=lambda: [1.0, 2.0, 4.0], description="backoff (s)")
    verify_checksum: bool = Field(False, description="debug: compare generation weights checksums after refit")

    _delays = field_validator("retry_delay_s")(check_delays)


class GRPOConfig(_Section):
    num_prompts_per_step: int = Field(8, ge=1, le=MAX_PROMPTS, description="<= 65536")
    num_generations_per_prompt: int = Field(
        4, ge=2, le=1024, description="group size; >= 2 for GRPO advantages, <= 1024 (and prompts * group <= 2**20)"
    )
    max_num_steps: int = Field(10, ge=1, le=MAX_STEPS, description="<= 10**7")
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = True
    val_period: int = Field(0, ge=0, le=MAX_STEPS, description="validate every N steps (0: never)")
    val_at_start: bool = False
    max_val_samples: int = Field(32, ge=1, le=MAX_DATASET_ROWS, description="<= 10**8")
    val_batch_size: int = Field(32, ge=1, le=MAX_ROWS, description="<= 2**20")
    seed: int = Field(42, ge=INT64[0], le=INT64[1], description="any 64-bit signed integer")
    stage_retries: int = Field(
        DEFAULT_STAGE_RETRIES, ge=0, le=MAX_RETRIES,
        description="Prefect retries of a stage that calls actors (generate, logprob, train, checkpoint, "
        "validate) after an actor fault; 0: the first fault fails the run; <= 100",
    )
    stage_retry_delay_s: list[float] = Field(
        default_factory=lambda: list(DEFAULT_STAGE_RETRY_DELAY_S),
        description="backoff before each stage retry (s, each <= 1 day, at most 50); the last value repeats",
    )
    refit: RefitConfig = Field(default_factory=RefitConfig)
    async_grpo: AsyncGRPOConfig = Field(default_factory=AsyncGRPOConfig)
    adv_estimator: AdvEstimatorConfig = Field(default_factory=AdvEstimatorConfig)
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    use_dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: train only on groups whose rewards differ, generating more "
        "batches until num_prompts_per_step such groups are found (nrl_tasks.algorithms.dynamic_sampling)",
    )
    batch_multiplier: int = Field(
        1, ge=1, le=1024, description="dynamic sampling: each generation batch draws batch_multiplier * "
        "num_prompts_per_step prompts; <= 1024",
    )
    dynamic_sampling_max_gen_batches: int = Field(
        10, ge=1, le=1000, description="dynamic sampling: generation batches per step before the step fails; <= 1000",
    )

    _delays = field_validator("stage_retry_delay_s")(check_delays)


class ArithmeticDataConfig(_Section):
    """Built-in task generator (``nrl_tasks.environments.arithmetic``)."""

    num_train: int = Field(
        1024, ge=1, le=MAX_DATASET_ROWS, description="size of the train pool (cycled over epochs), <= 10**8"
    )
    num_val: int = Field(64, ge=1, le=MAX_DATASET_ROWS, description="<= 10**8")
    max_operand: int = Field(9, ge=0, le=10**18, description="<= 10**18")
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"], max_length=16)
    few_shot: int = Field(0, ge=0, le=1024, description="solved examples prefixed to every prompt, <= 1024")


class DataConfig(_Section):
    dataset: Literal["arithmetic", "file"] = "arithmetic"
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
        return self


class RewardModelConfig(_Section):
    enabled: bool = False
    model_name: str | None = Field(None, description="local path of a sequence-classification model")


class EnvConfig(_Section):
    name: Literal["arithmetic"] = "arithmetic"
    reward_fn: str | None = Field(None, description="'package.module:function' (default: exact match)")
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)

    @model_validator(mode="after")
    def _check(self) -> "EnvConfig":
        if self.reward_fn is not None:
            mod, _, fn = self.reward_fn.partition(":")
            if not mod or not fn or ":" in fn:
                raise ValueError(f"env.reward_fn must look like 'package.module:function', got {self.reward_fn!r}")
        if self.reward_model.enabled:
            if self.reward_fn is not None:
                raise ValueError("env.reward_fn and env.reward_model.enabled are mutually exclusive")
            if not self.reward_model.model_name:
                raise ValueError("env.reward_model.model_name is required when env.reward_model.enabled")
        return self


class CheckpointingConfig(_Section):
    enabled: bool = True
    save_period: int = Field(10, ge=1, le=MAX_STEPS, description="checkpoint every N steps (and at the end)")
    keep_last_k: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="retention: keep only the newest K (None: all)"
    )
    keep_top_k: int | None = Field(
        None, ge=1, le=MAX_STEPS, description="retention: also keep the K best by metric_name (None: off)"
    )
    metric_name: str = Field("val_accuracy", description="metrics.jsonl column ranking checkpoints for keep_top_k")
    higher_is_better: bool = True
    save_optimizer: bool = True


class RayConfig(_Section):
    address: str | None = Field(None, description="GCS address of a running cluster (None: RAY_ADDRESS or local)")
    num_cpus: int | None = Field(
        None, ge=1, le=1 << 16, description="logical CPUs of a local Ray (None: default; <= 65536)"
    )
    policy_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per policy worker bundle (node placement)"
    )
    generation_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per generation worker bundle (node placement)"
    )


class ClusterConfig(_Section):
    num_nodes: int = Field(1, ge=1, le=1 << 16, description="<= 65536")
    gpus_per_node: int = Field(0, ge=0, le=64, description="<= 64")
    policy_workers: int = Field(1, ge=1, le=MAX_WORKERS, description="data-parallel trainer workers (<= 1024)")
    num_cpus_per_worker: float = Field(1.0, ge=0, le=MAX_WORKERS, description="<= 1024")
    ray: RayConfig = Field(default_factory=RayConfig)


class StorageRetryConfig(_Section):
    """Backoff of remote-storage calls that fail transiently (endpoint down, throttled, 5xx).

    Waits ``initial_delay_s``, doubling up to ``max_delay_s``, for ``attempts`` calls in all; the
    defaults wait out ~40 s of outage. See ``storage.retry``.
    """

    attempts: int = Field(8, ge=1, le=MAX_RETRIES, description="calls in all (1: no retry; <= 100)")
    initial_delay_s: float = Field(0.5, ge=0, le=MAX_SECONDS, description="first backoff (s, <= 1 day)")
    max_delay_s: float = Field(10.0, ge=0, le=MAX_SECONDS, description="longest backoff (s, <= 1 day)")

    def policy(self) -> Any:
        """The ``storage.retry.RetryPolicy`` of these settings."""
        from storage.retry import RetryPolicy

        return RetryPolicy(attempts=self.attempts, initial_delay_s=self.initial_delay_s, max_delay_s=self.max_delay_s)


class StorageConfig(_Section):
    """Where a run's files go. Credentials never go here: they come from the environment
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL``)
    or an AWS profile (``storage_options: {profile: name}``), because the config is saved with the
    run and sent to Prefect as a flow parameter."""

    root: str = Field("./runs", description="local path, file:// or s3://bucket/prefix")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec/s3fs options without credentials (endpoint_url, profile, ...)"
    )
    keep_last_k_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="retention of step batches (None: all)")
    fsync: bool = Field(
        True,
        description=(
            "fsync each stage dataset (shards, manifest, directory) before it counts as committed; false keeps "
            "datasets consistent across killed processes (the page cache survives them) but not across a power "
            "loss or kernel crash (local storage only)"
        ),
    )
    retry: StorageRetryConfig = Field(default_factory=StorageRetryConfig, description="remote-storage backoff")

    @model_validator(mode="after")
    def _no_credentials(self) -> "StorageConfig":
        found = credential_paths(self.storage_options)
        if found:
            raise ValueError(
                f"storage.storage_options.{found[0]} looks like a credential: configs are saved with the run and "
                "sent to Prefect, so set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN in the "
                "environment (or storage.storage_options.profile) instead"
            )
        return self


class WarmStartConfig(_Section):
    """A supervised warm start the GRPO flow runs first (not a NeMo-RL key; :mod:`flows.warm_start`)."""

    sft_steps: int = Field(0, ge=0, le=100_000, description="SFT steps on the reference answers before GRPO (0: none)")
    batch_size: int = Field(32, ge=1, le=65_536, description="prompts per SFT step")
    lr: float | None = Field(None, gt=0, le=1.0, description="SFT learning rate (default policy.optimizer.kwargs.lr)")


class MasterConfig(_Section):
    """Everything a GRPO run needs. See ``configs/grpo_tiny.yaml``."""

    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    loss_fn: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig)
    policy: PolicyConfig
    generation: GenerationConfig | None = Field(None, description="default: policy.generation")
    data: DataConfig = Field(default_factory=DataConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    dpo: DPOConfig | None = Field(None, description="set: a DPO run (nrl dpo; flows.config_dpo)")
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)

    @model_validator(mode="after")
    def _combinations(self) -> "MasterConfig":
        errors = combination_errors(self)
        if errors:
            raise ValueError("; ".join(errors))
        return self

    @property
    def rollout_batch_size(self) -> int:
        """Rows of one step: ``num_prompts_per_step * num_generations_per_prompt``."""
        return self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt

    @property
    def has_generation(self) -> bool:
        """Whether the run has generation workers (a DPO run has none)."""
        return self.generation is not None or getattr(self.policy, "generation", None) is not None

    @property
    def gen(self) -> GenerationConfig:
        """The effective generation config (top-level ``generation`` or ``policy.generation``)."""
        g = self.generation or getattr(self.policy, "generation", None)
        if g is None:  # pragma: no cover - excluded by validation
            raise ConfigError("no generation config: set `generation` or `policy.generation`")
        return g

    def generation_config(self) -> GenerationConfig:
        """The generation config the workers run: ``model_name`` defaults to the policy's and
        built-in model names are resolved to local folders. With LoRA on and the vLLM backend,
        vLLM's LoRA support is switched on for the adapters-only refits (``llm_kwargs``
        ``enable_lora``, ``max_lora_rank`` = ``lora_cfg.dim``, one adapter at a time), unless
        ``generation.vllm_cfg.llm_kwargs`` sets those keys itself."""
        from flows.models import resolve_model_path

        g = self.gen
        update: dict[str, Any] = {"model_name": resolve_model_path(g.model_name or self.policy.model_name)}
        lora = self.policy.dtensor_cfg.lora_cfg
        if g.backend == "vllm" and lora.enabled:
            llm_kwargs = {"enable_lora": True, "max_lora_rank": lora.dim, "max_loras": 1, **g.vllm_cfg.llm_kwargs}
            update["vllm_cfg"] = g.vllm_cfg.model_copy(update={"llm_kwargs": llm_kwargs})
        return g.model_copy(update=update)

    def policy_config(self) -> PolicyConfig:
        """The PolicyConfig the actors run: ``generation`` filled in (its temperature divides the
        logits in ``get_logprobs``/``train``; its precision is the refit dtype) and built-in model
        names resolved to local folders."""
        from flows.models import resolve_model_path

        p = self.policy
        update: dict[str, Any] = {  # a DPO run has no generation config
            "model_name": resolve_model_path(p.model_name), "generation": self.generation_config() if self.has_generation else None,
        }
        if p.tokenizer.name:
            update["tokenizer"] = p.tokenizer.model_copy(update={"name": resolve_model_path(p.tokenizer.name)})
        return p.model_copy(update=update)

    def max_prompt_tokens(self) -> int:
        """Token budget of one prompt: explicit, or what the sequence length leaves."""
        if self.data.max_input_seq_length is not None:
            return self.data.max_input_seq_length
        return self.policy.max_total_sequence_length - self.gen.max_new_tokens


# ----------------------------------------------------------------------------------------------
# loading, hashing, saving


def _validation_lines(exc: ValidationError, skip: dict[str, str]) -> list[str]:
    """One ``  - key: message`` line per pydantic error, leaving out keys already in ``skip`` (and a
    list whose item is there: ``betas: must lie in [0, 1)`` after ``betas.1: must be finite``)."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "__root__")
        inp = err.get("input")
        if loc in skip or (
            isinstance(inp, (list, tuple)) and any(f"{loc}.{i}" in skip for i in range(len(inp)))
        ):
            continue
        msg = err.get("msg", "")
        if err.get("type") == "extra_forbidden":
            msg = "unknown key"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        shown = "" if err.get("type") in ("extra_forbidden", "missing") or isinstance(inp, dict) else f" (got {inp!r})"
        lines.append(f"  - {loc or '<root>'}: {msg}{shown}")
    return lines


def load_config_dict(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML config file into a dict (``ConfigError`` naming the file on failure).

    Read by :func:`flows.config_io.load_yaml_file`: at most 1 MiB, no repeated keys, bounded
    alias expansion, a non-empty mapping. A saved ``config_hash`` is dropped.
    """
    data = load_yaml_file(path)
    data.pop("config_hash", None)
    return data


def load_config_text(text: str, source: str) -> dict[str, Any]:
    """Like :func:`load_config_dict` for the text of a config read from ``source`` (a path or URI,
    named in every error), e.g. a run's saved ``config.yaml``."""
    data = load_yaml_text(text, source)
    data.pop("config_hash", None)
    return data


def load_config(
    source: str | os.PathLike[str] | dict[str, Any] | MasterConfig | None = None,
    overrides: Iterable[str] = (),
    *,
    name: str | None = None,
) -> MasterConfig:
    """Build a validated :class:`MasterConfig` from a YAML path, a dict or a config, plus overrides.

    Raises :class:`ConfigError` listing every problem at once, headed by ``name`` (default: the
    path, or ``<dict>`` / ``<config object>`` / ``<defaults>``). Only this entry point also runs
    :func:`flows.config_bounds.value_errors` (booleans as numbers, inf/nan, the ``nrl_tasks``
    sections' maxima); ``MasterConfig.model_validate`` alone does not.
    """
    overrides = list(overrides or ())
    if isinstance(source, MasterConfig):
        if not overrides:
            return source
        data, label = source.model_dump(mode="json", exclude_none=False), "<config object>"
    elif isinstance(source, dict):
        data, label = {k: v for k, v in source.items() if k != "config_hash"}, "<dict>"
    elif source is None:
        data, label = {}, "<defaults>"
    else:
        data, label = load_config_dict(source), repr(os.fspath(source))
    label = repr(name) if name else label
    try:
        data = apply_overrides(data, overrides)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    found = value_errors(MasterConfig, data)  # booleans as numbers, inf/nan, sizes out of range
    lines = [f"  - {key}: {msg}" for key, msg in found.items()]
    try:
        cfg = MasterConfig.model_validate(data)
    except ValidationError as exc:
        lines += _validation_lines(exc, skip=found)
    if lines:
        raise ConfigError(f"invalid config {label}:\n" + "\n".join(lines))
    return cfg


# the hash and the saved form live in flows.config_hash; their names stay importable from here
from flows.config_hash import changed_keys, config_hash, config_to_yaml, hashed_data, saved_config_hash  # noqa: E402
