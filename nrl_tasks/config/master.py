"""The whole run config: :class:`MasterConfig`, one field per section (loaded, overridden and
saved by ``flows.config``; its hash: :mod:`nrl_tasks.config.hash`)."""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Discriminator, Field, Tag, model_validator

from nrl_tasks.algorithms.distillation import DistillationLossConfig
from nrl_tasks.algorithms.loss_functions import ClippedPGLossConfig
from nrl_tasks.algorithms.value_loss import ValueLossConfig
from nrl_tasks.config.base import Section
from nrl_tasks.config.cluster import CheckpointingConfig, ClusterConfig, StorageConfig
from nrl_tasks.config.combinations import combination_errors
from nrl_tasks.config.data import DataConfig, EnvConfig
from nrl_tasks.config.distillation import DistillationConfig
from nrl_tasks.config.dpo import DPOConfig
from nrl_tasks.config.errors import ConfigError
from nrl_tasks.config.grpo import GRPOConfig, WarmStartConfig
from nrl_tasks.config.logger import LoggerConfig
from nrl_tasks.config.ppo import PPOConfig
from nrl_tasks.config.rm import RMConfig
from nrl_tasks.config.sft import SFTConfig
from nrl_tasks.models.builtin import resolve_model_path
from nrl_tasks.models.generation.interfaces import GenerationConfig
from nrl_tasks.models.policy import PolicyConfig

__all__ = ["ALGORITHM_SECTIONS", "DEFAULT_KIND", "LOSS_TAGS", "MasterConfig", "SECTION_KINDS", "config_kind", "section_of"]

#: sections that make a config a run of their algorithm
ALGORITHM_SECTIONS: tuple[str, ...] = ("dpo", "sft", "rm", "distillation", "ppo")
#: the run kind of each of them where it is not the section's name (``nrl distill``)
SECTION_KINDS: dict[str, str] = {"distillation": "distill"}
#: the kind of a config with none of them (GRPO's section has defaults: every config has one)
DEFAULT_KIND = "grpo"


def config_kind(data: Any) -> str:
    """The run kind of a config (a :class:`MasterConfig` or its data): its ``algorithm`` key when
    set, else the one of :data:`ALGORITHM_SECTIONS` it has, else :data:`DEFAULT_KIND`.
    ``ConfigError`` when two algorithm sections are set, or the key names another algorithm
    than the section it has.

    >>> config_kind({"dpo": {}}), config_kind({"grpo": {}}), config_kind({"algorithm": "m:R"})
    ('dpo', 'grpo', 'm:R')
    """
    get = data.get if isinstance(data, dict) else (lambda k: getattr(data, k, None))
    sections = [s for s in ALGORITHM_SECTIONS if get(s) is not None]
    if len(sections) > 1:
        raise ConfigError(f"the config has the sections {' and '.join(f'`{s}`' for s in sections)}: one run trains one "
                          "algorithm (drop one)")
    kinds = [SECTION_KINDS.get(s, s) for s in sections]
    named = get("algorithm")
    if named is not None and kinds and kinds[0] != named:
        raise ConfigError(f"algorithm = {named!r}, but the config has the `{sections[0]}` section of {kinds[0]}")
    return str(named) if named is not None else kinds[0] if kinds else DEFAULT_KIND


def section_of(kind: str) -> str:
    """The config section of a registered run kind (``distill`` -> ``distillation``).

    >>> section_of("distill"), section_of("dpo")
    ('distillation', 'dpo')
    """
    return next((s for s, k in SECTION_KINDS.items() if k == kind), kind)


#: the two forms of ``loss_fn`` (pydantic names them in an error's location: ``loss_fn.<tag>.<key>``)
LOSS_TAGS = ("clipped_pg", "distillation")


def _loss_tag(value: Any) -> str:
    """Which ``loss_fn`` a section's data is: distillation's when it has one of its keys."""
    if isinstance(value, DistillationLossConfig):
        return "distillation"
    if isinstance(value, dict) and set(value) & set(DistillationLossConfig.model_fields):
        return "distillation"
    return "clipped_pg"


#: NeMo-RL's ``loss_fn`` section: GRPO's clipped policy gradient, or distillation's KL
LossSection = Annotated[
    Union[Annotated[ClippedPGLossConfig, Tag("clipped_pg")], Annotated[DistillationLossConfig, Tag("distillation")]],
    Discriminator(_loss_tag),
]


class MasterConfig(Section):
    """Everything a run needs (GRPO, DPO, SFT, ...). See ``configs/grpo_tiny.yaml``."""

    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    loss_fn: LossSection = Field(default_factory=ClippedPGLossConfig)
    policy: PolicyConfig
    generation: GenerationConfig | None = Field(None, description="default: policy.generation")
    data: DataConfig = Field(default_factory=DataConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    dpo: DPOConfig | None = Field(None, description="set: a DPO run (nrl dpo; nrl_tasks.config.dpo)")
    sft: SFTConfig | None = Field(None, description="set: an SFT run (nrl sft; nrl_tasks.config.sft)")
    rm: RMConfig | None = Field(None, description="set: a reward-model training run (nrl rm; nrl_tasks.config.rm)")
    distillation: DistillationConfig | None = Field(
        None, description="set: an on-policy distillation run (nrl distill; nrl_tasks.config.distillation)")
    teacher: PolicyConfig | None = Field(None, description="distillation's teacher: a policy config run without optimizer")
    ppo: PPOConfig | None = Field(None, description="set: a PPO run with a value model (nrl ppo; nrl_tasks.config.ppo)")
    value: PolicyConfig | None = Field(None, description="PPO's value model (a policy config with a one-output head; "
                                       "default: the policy's)")
    value_loss_fn: ValueLossConfig = Field(default_factory=ValueLossConfig)
    algorithm: str | None = Field(
        None, min_length=1, max_length=200, pattern=r"^[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?$",
        description="the run's algorithm (not a NeMo-RL key): a registered kind (grpo, dpo, sft, rm, distill, ppo) or module:attribute "
        "of a recipe; default: the algorithm whose section the config has (grpo without one)",
    )
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)

    @model_validator(mode="before")
    @classmethod
    def _distillation_loss(cls, data: Any) -> Any:
        """A distillation run without ``loss_fn`` gets distillation's defaults (NeMo-RL's); its
        loss keys in another run are refused, naming them."""
        if not isinstance(data, dict):
            return data
        loss = data.get("loss_fn")
        if data.get("distillation") is None:
            keys = sorted(set(loss) & set(DistillationLossConfig.model_fields)) if isinstance(loss, dict) else []
            if keys:
                raise ValueError(f"loss_fn.{', loss_fn.'.join(keys)}: distillation's keys, and this config has no "
                                 "`distillation` section (add one, or drop them)")
        elif not loss:
            data = {**data, "loss_fn": DistillationLossConfig()}
        return data

    @model_validator(mode="after")
    def _combinations(self) -> "MasterConfig":
        errors = combination_errors(self)
        if errors:
            raise ValueError("; ".join(errors))
        return self

    @property
    def kind(self) -> str:
        """The run's algorithm (:func:`config_kind`)."""
        return config_kind(self)

    @property
    def rollout(self) -> GRPOConfig | DistillationConfig | PPOConfig:
        """The section whose sampling keys the stages that sample and validate read
        (``num_prompts_per_step``, ``num_generations_per_prompt``, ``max_rollout_turns``, ``seed``,
        ``val_batch_size``, ``max_val_samples``): ``distillation`` or ``ppo`` in those runs, else ``grpo``."""
        return self.distillation or self.ppo or self.grpo

    @property
    def rollout_section(self) -> str:
        """The name of :attr:`rollout`'s section (for messages naming its keys)."""
        return "distillation" if self.distillation is not None else "ppo" if self.ppo is not None else "grpo"

    @property
    def reward_keys(self) -> GRPOConfig | PPOConfig:
        """The section whose ``reward_scaling`` and ``reward_shaping`` the ``score`` stage applies
        (``ppo`` in a PPO run, else ``grpo``)."""
        return self.ppo or self.grpo

    def value_config(self) -> PolicyConfig:
        """PPO's value model as its workers run it: the ``value`` section (default: the policy's,
        without sequence packing, which the per-token head has not), a one-output head
        (``reward_model_cfg``), built-in model names resolved."""
        base = self.value if self.value is not None else self.policy
        data = base.model_dump(mode="json")
        if self.value is None:
            data["sequence_packing"] = {**data["sequence_packing"], "enabled": False}
        data.update(model_name=resolve_model_path(base.model_name), generation=None,
                    reward_model_cfg={"enabled": True, "reward_model_type": "regression"})
        if base.tokenizer.name:
            data["tokenizer"] = {**data["tokenizer"], "name": resolve_model_path(base.tokenizer.name)}
        return type(base).model_validate(data)

    @property
    def rollout_batch_size(self) -> int:
        """Rows of one step: ``num_prompts_per_step * num_generations_per_prompt``."""
        return self.rollout.num_prompts_per_step * self.rollout.num_generations_per_prompt

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
