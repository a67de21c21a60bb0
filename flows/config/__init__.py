"""The run configuration, loaded: YAML + dotted overrides, validated by pydantic before anything starts.

The schema (every section, its bounds and cross-field checks, the config hash) is
:mod:`nrl_tasks.config`; this module reads, overrides and saves it, and re-exports its names
(``from flows.config import MasterConfig, ConfigError, config_hash, ...``).

Keys keep NeMo-RL's names where they exist (``grpo.num_prompts_per_step``,
``grpo.num_generations_per_prompt``, ``grpo.max_num_steps``, ``grpo.val_period``,
``checkpointing.save_period``, ``policy.model_name``, ``policy.train_global_batch_size``,
``loss_fn.reference_policy_kl_penalty``, ...). Every section forbids unknown keys; all problems
found are reported together in one :class:`ConfigError` (a ``ValueError``). Numbers are finite,
booleans are not numbers and sizes have maxima a real run stays far below (:mod:`nrl_tasks.config.bounds`);
YAML is read by one bounded loader that refuses repeated keys (:mod:`flows.config.io`).

The *config hash* (:mod:`nrl_tasks.config.hash`) covers everything that changes the numbers a run produces; it leaves out
where things run and are written (``cluster.ray``, ``storage``), how they are shown
(``logger``), the length of the run (``grpo.max_num_steps``, so a finished run can be extended),
retry settings (``grpo.refit``, ``grpo.stage_retries``, ``grpo.stage_retry_delay_s``) and the
checkpoint cadence/retention. Resuming with a different hash is refused.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable

import yaml
from pydantic import ValidationError

from flows.config.compose import compose_file, resolve_interpolations
from flows.config.io import load_yaml_text
from flows.config.nemo_rl import translate
from flows.config.overrides import apply_overrides
from nrl_tasks.config.bounds import value_errors
from nrl_tasks.config.cluster import (
    CheckpointingConfig,
    ClusterConfig,
    RayConfig,
    StorageConfig,
    StorageRetryConfig,
)
from nrl_tasks.config.credentials import credential_paths, redact
from nrl_tasks.config.data import DataConfig, EnvConfig
from nrl_tasks.config.errors import ConfigError
from nrl_tasks.config.grpo import GRPOConfig, RefitConfig
from nrl_tasks.config.hash import changed_keys, config_hash, hashed_data
from nrl_tasks.config.logger import LoggerConfig, MLflowConfig, WandbConfig
from nrl_tasks.config.master import LOSS_TAGS, MasterConfig

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
    "read_config_data",
    "redact",
    "saved_config_hash",
]


_log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# loading and saving


def _validation_lines(exc: ValidationError, skip: dict[str, str]) -> list[str]:
    """One ``  - key: message`` line per pydantic error, leaving out keys already in ``skip`` (and a
    list whose item is there: ``betas: must lie in [0, 1)`` after ``betas.1: must be finite``)."""
    lines = []
    for err in exc.errors():
        parts = [str(p) for p in err.get("loc", ()) if p != "__root__"]
        if parts[:1] == ["loss_fn"] and parts[1:2] and parts[1] in LOSS_TAGS:  # which loss_fn: not a key of the file
            del parts[1]
        loc = ".".join(parts)
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

    Each file is read by :func:`flows.config.io.load_yaml_file`: at most 1 MiB, no repeated keys,
    bounded alias expansion, a non-empty mapping. NeMo-RL's ``defaults:`` parents are merged in
    (:func:`flows.config.compose.compose_file`); ``${...}`` interpolations are left for
    :func:`load_config` to resolve after the overrides. A saved ``config_hash`` is dropped.
    """
    data = compose_file(path)
    data.pop("config_hash", None)
    return data


def load_config_text(text: str, source: str) -> dict[str, Any]:
    """Like :func:`load_config_dict` for the text of a config read from ``source`` (a path or URI,
    named in every error), e.g. a run's saved ``config.yaml``."""
    data = load_yaml_text(text, source)
    data.pop("config_hash", None)
    return data


def read_config_data(source: str | os.PathLike[str] | dict[str, Any], overrides: Iterable[str] = ()) -> dict[str, Any]:
    """A config's data (a YAML path or a dict) with ``overrides`` applied, not validated: what
    tells its kind before its algorithm is known (:func:`nrl_tasks.config.master.config_kind`)."""
    data = dict(source) if isinstance(source, dict) else load_config_dict(source)
    try:
        return apply_overrides(data, list(overrides))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def load_config(
    source: str | os.PathLike[str] | dict[str, Any] | MasterConfig | None = None,
    overrides: Iterable[str] = (),
    *,
    name: str | None = None,
) -> MasterConfig:
    """Build a validated :class:`MasterConfig` from a YAML path, a dict or a config, plus overrides.

    Raises :class:`ConfigError` listing every problem at once, headed by ``name`` (default: the
    path, or ``<dict>`` / ``<config object>`` / ``<defaults>``). ``${...}`` interpolations are
    resolved after the overrides (:func:`flows.config.compose.resolve_interpolations`), so the
    resolved values are what is validated, saved and hashed. Only this entry point also runs
    :func:`nrl_tasks.config.bounds.value_errors` (booleans as numbers, inf/nan, the ``nrl_tasks``
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
    data = resolve_interpolations(data, label)
    nemo = translate(data)  # NeMo-RL's keys: honoured, mapped, ignored (one warning) or refused by name
    if (notice := nemo.notice()) is not None:
        _log.warning("config %s: %s", label, notice)
    data = nemo.data
    found = value_errors(MasterConfig, data)  # booleans as numbers, inf/nan, sizes out of range
    lines = [f"  - {line}" for line in nemo.errors] + [f"  - {key}: {msg}" for key, msg in found.items()]
    try:
        cfg = MasterConfig.model_validate(data)
    except ValidationError as exc:
        lines += _validation_lines(exc, skip=found)
    if lines:
        raise ConfigError(f"invalid config {label}:\n" + "\n".join(lines))
    return cfg


def config_to_yaml(cfg: MasterConfig) -> str:
    """The resolved config as YAML, starting with its hash; credentials redacted.

    ``config_hash`` is ignored on load. ``storage.storage_options`` values whose key looks like a
    secret are written as ``***`` (they never reach storage, logs or artifacts).
    """
    data = {"config_hash": config_hash(cfg), **cfg.model_dump(mode="json")}
    data["storage"] = redact(data["storage"])
    return yaml.safe_dump(data, sort_keys=False)


def saved_config_hash(text: str, source: str = "config.yaml") -> str | None:
    """The ``config_hash`` recorded in a saved ``config.yaml`` text (``ConfigError`` naming
    ``source`` when the text is not a config)."""
    return load_yaml_text(text, source).get("config_hash")
