"""The run configuration: YAML + dotted overrides, validated by pydantic before anything starts.

Keys keep NeMo-RL's names where they exist (``grpo.num_prompts_per_step``,
``grpo.num_generations_per_prompt``, ``grpo.max_num_steps``, ``grpo.val_period``,
``checkpointing.save_period``, ``policy.model_name``, ``policy.train_global_batch_size``,
``loss_fn.reference_policy_kl_penalty``, ...). Every section forbids unknown keys; all problems
found are reported together in one :class:`ConfigError` (a ``ValueError``).

The *config hash* covers everything that changes the numbers a run produces; it leaves out
where things run and are written (``cluster.ray``, ``storage``), how they are shown
(``logger``), the length of the run (``grpo.max_num_steps``, so a finished run can be extended),
retry settings (``grpo.refit``, ``grpo.stage_retries``, ``grpo.stage_retry_delay_s``) and the
checkpoint cadence/retention. Resuming with a different hash is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flows.overrides import apply_overrides
from nrl_tasks.algorithms.loss_functions import ClippedPGLossConfig
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
    "MasterConfig",
    "RayConfig",
    "RefitConfig",
    "StorageConfig",
    "StorageRetryConfig",
    "config_hash",
    "config_to_yaml",
    "credential_paths",
    "load_config",
    "load_config_dict",
    "redact",
    "saved_config_hash",
]


class ConfigError(ValueError):
    """A configuration problem (unknown key, wrong type, impossible combination, missing file)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _check_delays(value: list[float]) -> list[float]:
    """Retry backoff list: each delay >= 0 s, at most 50 (Prefect's limit); the last one repeats."""
    bad = [d for d in value if not d >= 0]  # also catches NaN
    if bad:
        raise ValueError(f"retry delays must be >= 0 seconds, got {bad[0]!r}")
    if len(value) > 50:
        raise ValueError(f"at most 50 retry delays (the last one repeats), got {len(value)}")
    return value


class RefitConfig(_Section):
    """How weights move from the Policy to the generation workers after each ``train``."""

    timeout_s: float = Field(120.0, gt=0, description="hard deadline of one refit attempt (s)")
    retries: int = Field(3, ge=0, description="Prefect retries of the refit task")
    retry_delay_s: list[float] = Field(default_factory=lambda: [1.0, 2.0, 4.0], description="backoff (s)")
    verify_checksum: bool = Field(False, description="debug: compare generation weights checksums after refit")

    _delays = field_validator("retry_delay_s")(_check_delays)


class GRPOConfig(_Section):
    num_prompts_per_step: int = Field(8, ge=1)
    num_generations_per_prompt: int = Field(4, ge=2, description="group size; >= 2 for GRPO advantages")
    max_num_steps: int = Field(10, ge=1)
    normalize_rewards: bool = True
    use_leave_one_out_baseline: bool = True
    val_period: int = Field(0, ge=0, description="validate every N steps (0: never)")
    val_at_start: bool = False
    max_val_samples: int = Field(32, ge=1)
    val_batch_size: int = Field(32, ge=1)
    seed: int = 42
    stage_retries: int = Field(
        DEFAULT_STAGE_RETRIES, ge=0,
        description="Prefect retries of a stage that calls actors (generate, logprob, train, checkpoint, "
        "validate) after an actor fault; 0: the first fault fails the run",
    )
    stage_retry_delay_s: list[float] = Field(
        default_factory=lambda: list(DEFAULT_STAGE_RETRY_DELAY_S),
        description="backoff before each stage retry (s); the last value repeats",
    )
    refit: RefitConfig = Field(default_factory=RefitConfig)

    _delays = field_validator("stage_retry_delay_s")(_check_delays)


class ArithmeticDataConfig(_Section):
    """Built-in task generator (``nrl_tasks.environments.arithmetic``)."""

    num_train: int = Field(1024, ge=1, description="size of the train pool (cycled over epochs)")
    num_val: int = Field(64, ge=1)
    max_operand: int = Field(9, ge=0)
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"])
    few_shot: int = Field(0, ge=0, description="solved examples prefixed to every prompt")


class DataConfig(_Section):
    dataset: Literal["arithmetic", "file"] = "arithmetic"
    train_path: str | None = Field(None, description="JSONL/Parquet/Arrow, local or s3://")
    val_path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    prompt_template: str = Field("{prompt}", description="str.format template with {prompt}")
    chat_template: bool = Field(False, description="wrap with the tokenizer's chat template")
    system_prompt: str | None = None
    max_input_seq_length: int | None = Field(None, ge=1, description="prompt token budget")
    overlong_prompts: Literal["truncate", "reject"] = "reject"
    shuffle: bool = True
    arithmetic: ArithmeticDataConfig = Field(default_factory=ArithmeticDataConfig)

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
    save_period: int = Field(10, ge=1, description="checkpoint every N steps (and at the end)")
    keep_last_k: int | None = Field(None, ge=1, description="retention: keep only the newest K (None: all)")
    keep_top_k: int | None = Field(None, ge=1, description="retention: also keep the K best by metric_name (None: off)")
    metric_name: str = Field("val_accuracy", description="metrics.jsonl column ranking checkpoints for keep_top_k")
    higher_is_better: bool = True
    save_optimizer: bool = True


class RayConfig(_Section):
    address: str | None = Field(None, description="GCS address of a running cluster (None: RAY_ADDRESS or local)")
    num_cpus: int | None = Field(None, ge=1, description="logical CPUs of a local Ray (None: default)")
    policy_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per policy worker bundle (node placement)"
    )
    generation_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per generation worker bundle (node placement)"
    )


class ClusterConfig(_Section):
    num_nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    policy_workers: int = Field(1, ge=1, description="data-parallel trainer workers")
    num_cpus_per_worker: float = Field(1.0, ge=0)
    ray: RayConfig = Field(default_factory=RayConfig)


class StorageRetryConfig(_Section):
    """Backoff of remote-storage calls that fail transiently (endpoint down, throttled, 5xx).

    Waits ``initial_delay_s``, doubling up to ``max_delay_s``, for ``attempts`` calls in all; the
    defaults wait out ~40 s of outage. See ``storage.retry``.
    """

    attempts: int = Field(8, ge=1, description="calls in all (1: no retry)")
    initial_delay_s: float = Field(0.5, ge=0, description="first backoff (s)")
    max_delay_s: float = Field(10.0, ge=0, description="longest backoff (s)")

    def policy(self) -> Any:
        """The ``storage.retry.RetryPolicy`` of these settings."""
        from storage.retry import RetryPolicy

        return RetryPolicy(attempts=self.attempts, initial_delay_s=self.initial_delay_s, max_delay_s=self.max_delay_s)


_CREDENTIAL_NAMES = {"key", "secret", "token", "password", "passwd", "access_key", "secret_key", "session_token"}
_CREDENTIAL_PARTS = ("secret", "password", "token", "credential", "access_key", "private_key")


def credential_paths(options: Any, prefix: str = "") -> list[str]:
    """Dotted paths of credential-looking keys in nested ``options`` (``key``, ``secret``, ``*token*``...).

    >>> credential_paths({"endpoint_url": "u", "key": "k", "client_kwargs": {"aws_secret_access_key": "s"}})
    ['key', 'client_kwargs.aws_secret_access_key']
    """
    out: list[str] = []
    if isinstance(options, dict):
        for name, value in options.items():
            low = str(name).lower()
            path = f"{prefix}{name}"
            if isinstance(value, dict):
                out += credential_paths(value, path + ".")
            elif value is not None and (low in _CREDENTIAL_NAMES or any(p in low for p in _CREDENTIAL_PARTS)):
                out.append(path)
    return out


class StorageConfig(_Section):
    """Where a run's files go. Credentials never go here: they come from the environment
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL``)
    or an AWS profile (``storage_options: {profile: name}``), because the config is saved with the
    run and sent to Prefect as a flow parameter."""

    root: str = Field("./runs", description="local path, file:// or s3://bucket/prefix")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec/s3fs options without credentials (endpoint_url, profile, ...)"
    )
    keep_last_k_steps: int | None = Field(None, ge=1, description="retention of step batches (None: all)")
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


class LoggerConfig(_Section):
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    console: bool = Field(True, description="print one progress line per step")
    artifacts: bool = Field(True, description="publish Prefect table/progress/markdown artifacts")
    num_rollouts_to_show: int = Field(4, ge=0, description="best and worst rollouts in the markdown artifact")
    weights_checksum: bool = Field(True, description="record the policy weights checksum after each train")
    step_subflows: bool = Field(
        True,
        description="group each step as a Prefect subflow run <run_id>-step-0007 (off: the step's tasks run "
        "directly in the run's flow run, named <stage>-<run_id>-step7 as always; a subflow costs ~0.1-1 s per step on a SQLite server)",
    )


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

    @model_validator(mode="after")
    def _combinations(self) -> "MasterConfig":
        errors = _combination_errors(self)
        if errors:
            raise ValueError("; ".join(errors))
        return self

    @property
    def rollout_batch_size(self) -> int:
        """Rows of one step: ``num_prompts_per_step * num_generations_per_prompt``."""
        return self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt

    @property
    def gen(self) -> GenerationConfig:
        """The effective generation config (top-level ``generation`` or ``policy.generation``)."""
        g = self.generation or getattr(self.policy, "generation", None)
        if g is None:  # pragma: no cover - excluded by validation
            raise ConfigError("no generation config: set `generation` or `policy.generation`")
        return g

    def generation_config(self) -> GenerationConfig:
        """The generation config the workers run: ``model_name`` defaults to the policy's and
        built-in model names are resolved to local folders."""
        from flows.models import resolve_model_path

        g = self.gen
        return g.model_copy(update={"model_name": resolve_model_path(g.model_name or self.policy.model_name)})

    def policy_config(self) -> PolicyConfig:
        """The PolicyConfig the actors run: ``generation`` filled in (its temperature divides the
        logits in ``get_logprobs``/``train``; its precision is the refit dtype) and built-in model
        names resolved to local folders."""
        from flows.models import resolve_model_path

        p = self.policy
        update: dict[str, Any] = {"model_name": resolve_model_path(p.model_name), "generation": self.generation_config()}
        if p.tokenizer.name:
            update["tokenizer"] = p.tokenizer.model_copy(update={"name": resolve_model_path(p.tokenizer.name)})
        return p.model_copy(update=update)

    def max_prompt_tokens(self) -> int:
        """Token budget of one prompt: explicit, or what the sequence length leaves."""
        if self.data.max_input_seq_length is not None:
            return self.data.max_input_seq_length
        return self.policy.max_total_sequence_length - self.gen.max_new_tokens


def _combination_errors(cfg: MasterConfig) -> list[str]:
    errs: list[str] = []
    pol_gen = getattr(cfg.policy, "generation", None)
    if cfg.generation is None and pol_gen is None:
        errs.append("generation: missing (set `generation` or `policy.generation`)")
        return errs
    if cfg.generation is not None and pol_gen is not None and cfg.generation != pol_gen:
        errs.append("generation and policy.generation are both set and differ: set only one")
    gen = cfg.generation or pol_gen
    b = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    gbs, mbs = cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size
    dp = cfg.cluster.policy_workers
    if b % gbs:
        errs.append(
            f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt = {b} is not a multiple of "
            f"policy.train_global_batch_size = {gbs}"
        )
    if gbs % (mbs * dp):
        errs.append(
            f"policy.train_global_batch_size = {gbs} is not a multiple of policy.train_micro_batch_size * "
            f"cluster.policy_workers = {mbs} * {dp}"
        )
    if gen.max_new_tokens >= cfg.policy.max_total_sequence_length:
        errs.append(
            f"generation.max_new_tokens = {gen.max_new_tokens} leaves no room for the prompt in "
            f"policy.max_total_sequence_length = {cfg.policy.max_total_sequence_length}"
        )
    elif cfg.data.max_input_seq_length is not None and (
        cfg.data.max_input_seq_length + gen.max_new_tokens > cfg.policy.max_total_sequence_length
    ):
        errs.append(
            f"data.max_input_seq_length + generation.max_new_tokens = "
            f"{cfg.data.max_input_seq_length + gen.max_new_tokens} exceeds policy.max_total_sequence_length = "
            f"{cfg.policy.max_total_sequence_length}"
        )
    if cfg.grpo.val_period and cfg.data.dataset == "file" and not cfg.data.val_path:
        errs.append("grpo.val_period > 0 with data.dataset 'file' needs data.val_path")
    if getattr(gen, "backend", "hf") == "vllm" and cfg.cluster.gpus_per_node == 0:
        errs.append("generation.backend 'vllm' needs cluster.gpus_per_node >= 1 (use 'hf' on CPU)")
    return errs


# ----------------------------------------------------------------------------------------------
# loading, hashing, saving


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "__root__")
        msg = err.get("msg", "")
        if err.get("type") == "extra_forbidden":
            msg = "unknown key"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        inp = err.get("input")
        shown = "" if err.get("type") in ("extra_forbidden", "missing") or isinstance(inp, dict) else f" (got {inp!r})"
        lines.append(f"  - {loc or '<root>'}: {msg}{shown}")
    return f"invalid config {source}:\n" + "\n".join(lines)


def load_config_dict(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML config file into a dict (``ConfigError`` naming the file on failure)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path!r} cannot be read as YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping at top level, got {type(data).__name__}")
    data.pop("config_hash", None)
    return data


def load_config(
    source: str | os.PathLike[str] | dict[str, Any] | MasterConfig | None = None,
    overrides: Iterable[str] = (),
) -> MasterConfig:
    """Build a validated :class:`MasterConfig` from a YAML path, a dict or a config, plus overrides.

    Raises :class:`ConfigError` listing every problem at once.
    """
    overrides = list(overrides or ())
    if isinstance(source, MasterConfig):
        if not overrides:
            return source
        data, name = source.model_dump(mode="json", exclude_none=False), "<config object>"
    elif isinstance(source, dict):
        data, name = {k: v for k, v in source.items() if k != "config_hash"}, "<dict>"
    elif source is None:
        data, name = {}, "<defaults>"
    else:
        data, name = load_config_dict(source), repr(os.fspath(source))
    try:
        data = apply_overrides(data, overrides)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return MasterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, name)) from None


_HASH_EXCLUDE: dict[str, Any] = {
    "cluster": {"ray"},
    "storage": True,
    "logger": True,
    "grpo": {"max_num_steps", "refit", "stage_retries", "stage_retry_delay_s"},
    "checkpointing": {"save_period", "keep_last_k", "keep_top_k", "metric_name", "higher_is_better"},
}


def config_hash(cfg: MasterConfig) -> str:
    """sha256 (16 hex chars) of the canonical JSON of the result-affecting part of ``cfg``."""
    data = cfg.model_dump(mode="json", exclude=_HASH_EXCLUDE)
    data["generation"] = cfg.gen.model_dump(mode="json")
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


_SECRET_WORDS = ("key", "secret", "token", "password", "credential")


def redact(obj: Any) -> Any:
    """Copy of ``obj`` with the values of secret-looking keys replaced by ``"***"``.

    >>> redact({"client_kwargs": {"endpoint_url": "u"}, "secret": "s", "key": "k"})
    {'client_kwargs': {'endpoint_url': 'u'}, 'secret': '***', 'key': '***'}
    """
    if isinstance(obj, dict):
        return {
            k: ("***" if any(w in str(k).lower() for w in _SECRET_WORDS) and not isinstance(v, dict) else redact(v))
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


def config_to_yaml(cfg: MasterConfig) -> str:
    """The resolved config as YAML, starting with its hash; credentials redacted.

    ``config_hash`` is ignored on load. ``storage.storage_options`` values whose key looks like a
    secret are written as ``***`` (they never reach storage, logs or artifacts).
    """
    data = {"config_hash": config_hash(cfg), **cfg.model_dump(mode="json")}
    data["storage"] = redact(data["storage"])
    return yaml.safe_dump(data, sort_keys=False)


def saved_config_hash(text: str) -> str | None:
    """The ``config_hash`` recorded in a saved ``config.yaml`` text."""
    data = yaml.safe_load(text) or {}
    return data.get("config_hash") if isinstance(data, dict) else None
