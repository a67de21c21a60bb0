"""The config hash of a run, and the one hashing helper of config data (:func:`digest`).

The hash covers everything that changes the numbers a run produces; it leaves out where things
run and are written (``cluster.ray``, ``storage``), how they are shown (``logger``), the length
of the run (``grpo.max_num_steps``, ``dpo.max_num_steps``, ...), retry settings and the checkpoint
cadence/retention; sections and keys added after runs existed count only when used, so older
runs keep their hashes. Resuming with a different hash is refused. Writing and reading the saved
``config.yaml`` (which starts with the hash) is the loader's job (:mod:`flows.config`).

:func:`digest` is the one hashing helper: the run's :func:`config_hash` is its first 16 hex
characters over :func:`hashed_data`; ``PolicyConfig.config_hash`` (which identifies the settings a
live policy runs, checked when a flow attaches to kept actors) is its full 64 over the policy section.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from nrl_tasks.config.base import flatten

if TYPE_CHECKING:
    from nrl_tasks.config.master import MasterConfig

__all__ = ["changed_keys", "config_hash", "digest", "hashed_data"]

_HASH_EXCLUDE: dict[str, Any] = {
    "cluster": {"ray"},
    "storage": True,
    "logger": True,
    "grpo": {"max_num_steps", "max_num_epochs", "refit", "stage_retries", "stage_retry_delay_s", "max_steps_without_valid_reward"},
    "checkpointing": {"save_period", "keep_last_k", "keep_top_k", "metric_name", "higher_is_better"},
    "dpo": {"max_num_steps", "max_num_epochs"},  # like grpo.max_num_steps: a finished DPO run can be extended
    "sft": {"max_num_steps", "max_num_epochs"},
    "rm": {"max_num_steps", "max_num_epochs"},
    "distillation": {"max_num_steps", "max_num_epochs"},
    "ppo": {"max_num_steps", "max_num_epochs"},
    "env": {"num_workers", "step_timeout_s"},  # how many actors run the environment and how long it may take, not what it answers
}


#: keys added after runs existed (issue 12): counted in the hash only when not at their default
_ADDED_KEYS: tuple[tuple[str, str], ...] = (
    ("grpo", "adv_estimator"),
    ("grpo", "reward_shaping"),
    ("grpo", "use_dynamic_sampling"),
    ("grpo", "batch_multiplier"),
    ("grpo", "dynamic_sampling_max_gen_batches"),
    ("grpo", "max_rollout_turns"),
    *(("grpo", k) for k in ("val_at_end", "overlong_filtering", "advantage_clip_low", "advantage_clip_high", "reward_scaling")),
    ("grpo", "stop_at_validation_metric"),
    ("grpo", "stop_at_validation_threshold"),
    ("env", "environment"),
    ("env", "environment_kwargs"),
    ("policy", "share_prompt_prefix"),
    ("data", "split_validation_size"),
    ("data", "split_seed"),
    *(("dpo", k) for k in ("val_period", "val_batches", "val_global_batch_size", "val_micro_batch_size", "val_at_start")),
    ("dpo", "val_at_end"),
    ("sft", "val_at_end"),
    *(("loss_fn", k) for k in (
        "use_kl_in_reward", "disable_ppo_ratio", "force_on_policy_ratio", "use_cispo", "truncated_importance_sampling_type",
        "truncated_importance_sampling_ratio_min", "sequence_level_importance_ratios", "positive_example_nll_weight",
        "constant_length_normalization",
    )),
)


def hashed_data(cfg: MasterConfig) -> dict[str, Any]:
    """The result-affecting part of ``cfg`` as JSON data (what :func:`config_hash` hashes).

    ``grpo.async_grpo`` and ``policy.dtensor_cfg.lora_cfg`` count only when enabled: a run
    without them hashes as before they existed;
    likewise the keys of :data:`_ADDED_KEYS` count only when they differ from their default."""
    data = cfg.model_dump(mode="json", exclude=_HASH_EXCLUDE)
    if not cfg.grpo.async_grpo.enabled:
        data["grpo"].pop("async_grpo", None)
    for section, key in _ADDED_KEYS:  # a key added later, at its default, hashes as before it existed
        model = getattr(cfg, section)
        if model is not None and key in data[section] and getattr(model, key) == type(model).model_fields[key].get_default(call_default_factory=True):
            data[section].pop(key)
    if not cfg.policy.dtensor_cfg.lora_cfg.enabled:  # a full-weights run hashes as before LoRA existed
        data["policy"]["dtensor_cfg"].pop("lora_cfg", None)
    for section in ("dpo", "sft", "rm", "distillation", "teacher", "ppo", "value", "algorithm"):  # a GRPO run hashes
        if data.get(section) is None:                                                           # as before these existed
            data.pop(section, None)
    if cfg.ppo is None:  # read by PPO runs only
        data.pop("value_loss_fn", None)
    if not cfg.warm_start.sft_steps:  # likewise a run without a warm start
        data.pop("warm_start", None)
    data["generation"] = cfg.gen.model_dump(mode="json") if cfg.has_generation else None
    return data


def digest(data: Any, chars: int = 64) -> str:
    """The first ``chars`` hex characters of the sha256 of ``data``'s canonical JSON (sorted keys,
    no spaces; a value JSON cannot write is written as its ``str``).

    >>> digest({"b": 1, "a": [1.5, None]}, 16) == digest({"a": [1.5, None], "b": 1})[:16]
    True
    """
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:chars]


def config_hash(cfg: MasterConfig) -> str:
    """sha256 (16 hex chars) of the canonical JSON of :func:`hashed_data`."""
    return digest(hashed_data(cfg), 16)


def changed_keys(a: MasterConfig, b: MasterConfig) -> list[str]:
    """Dotted keys whose result-affecting values differ between ``a`` and ``b`` (sorted).

    >>> from nrl_tasks.config.master import MasterConfig
    >>> base = MasterConfig.model_validate({"policy": {"model_name": "m"}, "generation": {}})
    >>> changed_keys(base, base.model_copy(update={"grpo": base.grpo.model_copy(update={"seed": 7, "max_num_steps": 9})}))
    ['grpo.seed']
    """
    fa, fb = flatten(hashed_data(a)), flatten(hashed_data(b))
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))
