"""What can be known about a run before anything starts: checked by the CLI before the Prefect
API, Ray or the run's directory exist, so a bad plug-in or data file costs a second, not the
60-90 s of starting servers, and leaves nothing behind (a run directory left by a failed start
would make the same ``--run-id`` refused).

:func:`preflight` raises ``ValueError`` naming the key, file or plug-in:

- ``env.reward_fn``, ``env.environment``: the module imports and the attribute is callable (an
  environment: is built); a user's module is imported first in a child process under
  ``NRL_PLUGIN_IMPORT_TIMEOUT_S``, so one that exits, hangs or raises anything at import is a
  ``ValueError`` naming the key and the module (:mod:`nrl_tasks.utils.import_path`);
- the stage plug-ins of ``NRL_PLUGINS`` load (imported the same way);
- ``policy.model_name`` / ``policy.tokenizer.name``: a built-in name is known, a local path is a
  folder (:func:`check_model_path`);
- the run's data, as its algorithm reads it (its recipe's ``check_data``): GRPO's prompt files
  (``data.train_path``, ``data.val_path`` when validation reads it, :func:`check_prompt_files`);
  prompts over the token budget, with the run's tokenizer when it loads from this machine;
  DPO's preference pairs (a resume's frozen snapshot is not checked again); SFT's rows;
- a local Ray (no ``cluster.ray.address`` / ``RAY_ADDRESS``) is sized to this machine:
  :func:`flows.run.ray_session.check_local_ray_size`.

The flow checks the same things again where it uses them (a deployment run skips the CLI).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flows.config import MasterConfig
from flows.run.plugins import load_observers
from flows.run.ray_session import check_local_ray_size
from flows.run.runtime import load_tokenizer
from nrl_tasks.environments.loading import make_environment
from nrl_tasks.environments.rewards import load_reward_fn
from nrl_tasks.models.builtin import is_builtin, is_known_builtin, resolve_model_path
from nrl_tasks.models.policy.workers.lora import check_lora_targets
from nrl_tasks.run_layout import RunLayout
from nrl_tasks.stages.data import check_prompt_lengths, load_prompt_records

__all__ = ["check_environment", "check_lora", "check_model_path", "check_plugins", "check_prompt_files", "check_reward_fn", "preflight"]


def _needs_val_split(cfg: MasterConfig) -> bool:
    return bool(cfg.data.val_path or cfg.data.split_validation_size) or cfg.rollout.val_period > 0 or cfg.rollout.val_at_start \
        or cfg.rollout.val_at_end


def check_reward_fn(cfg: MasterConfig) -> None:
    """``ValueError`` naming ``env.reward_fn`` when it does not import or is not callable (the
    flow calls this too, before Ray starts: a deployment run skips the CLI's preflight)."""

    if cfg.env.reward_fn is not None:
        try:
            load_reward_fn(cfg.env.reward_fn, isolate=True)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"env.reward_fn: {exc}") from None


def check_environment(cfg: MasterConfig) -> None:
    """``ValueError`` naming ``env.environment`` when the environment does not import, is not an
    environment class or cannot be built with ``env.environment_kwargs`` (built here once, in this
    process, before Ray starts; whatever its constructor raises, an exit included, is a ``ValueError``)."""

    env = cfg.env
    if env.environment is None:
        return
    try:
        make_environment(env.environment, env.environment_kwargs, isolate=True)
    except ValueError:
        raise
    except BaseException as exc:  # noqa: BLE001 - a user's constructor may raise anything, exits included
        raise ValueError(
            f"env.environment {env.environment!r} with env.environment_kwargs {env.environment_kwargs or {}!r}: "
            f"building it raised {type(exc).__name__}: {exc}"
        ) from exc


def check_plugins(cfg: MasterConfig) -> None:
    """The user code a run imports by name: ``env.reward_fn`` and ``env.environment``."""
    check_reward_fn(cfg)
    check_environment(cfg)


def check_model_path(cfg: MasterConfig, layout: RunLayout | None = None) -> None:
    """``ValueError`` naming ``policy.model_name`` (or ``policy.tokenizer.name``) when it is an
    unknown ``builtin:`` name or a local path (absolute, ``./``, ``~``) that is not a folder; a hub
    id (``org/name``) is left to the loader. A resumed run's (``layout``) model below its storage
    root is one its own start makes (a warm start's SFT weights): the flow checks it."""
    import os

    own = layout.root.removeprefix("file://").rstrip("/") + "/" if layout is not None else None
    for key, name in (("policy.model_name", cfg.policy.model_name), ("policy.tokenizer.name", cfg.policy.tokenizer.name)):
        if not name or (own and name.removeprefix("file://").startswith(own)):
            continue
        if is_builtin(name):
            if not is_known_builtin(name):
                raise ValueError(f"{key}: unknown built-in model {name!r} (use builtin:tiny, builtin:tiny-seed<N> or builtin:smollm2)")
        elif name.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(name)):
            raise ValueError(f"{key}: {name!r} is not a model folder (no such directory)")


def check_lora(cfg: MasterConfig) -> None:
    """``ValueError`` naming ``policy.dtensor_cfg.lora_cfg.target_modules`` / ``exclude_modules``
    when LoRA is enabled and an entry names no module of the policy model, or nothing is left to
    adapt: checked on the meta device from the model's ``config.json``, before Ray starts (was:
    60-108 s later, in ``PolicyWorker.setup``)."""
    lora = cfg.policy.dtensor_cfg.lora_cfg
    if not lora.enabled:
        return

    check_lora_targets(resolve_model_path(cfg.policy.model_name), lora)


def preflight(cfg: MasterConfig, layout: RunLayout | None = None, *,
              check_data: Callable[[MasterConfig, RunLayout | None], None] | None = None) -> None:
    """Raise ``ValueError`` for the first problem of ``cfg`` found without starting anything
    (``layout``: the run a resume continues; ``check_data``: the run's algorithm's data check,
    its recipe's ``check_data``)."""

    check_model_path(cfg, layout)
    check_lora(cfg)
    check_plugins(cfg)
    load_observers(isolate=True)
    if check_data is not None:
        check_data(cfg, layout)
    check_local_ray_size(cfg)


def check_prompt_files(cfg: MasterConfig) -> None:
    """``ValueError`` naming ``data.train_path`` / ``data.val_path`` (GRPO's prompt files) when one
    does not read, the train split is empty, or a prompt is longer than the token budget (with
    ``data.overlong_prompts: reject``; the run's tokenizer, when it loads from this machine)."""

    opts = cfg.storage.storage_options or None
    tokenizer = None
    splits = ["train"] + (["val"] if _needs_val_split(cfg) else [])
    for split in splits:
        try:
            records = load_prompt_records(cfg.data, split, cfg.rollout.seed, opts)
        except (OSError, ValueError) as exc:
            key = f"data.{split}_path" if cfg.data.dataset == "file" else f"data.arithmetic ({split})"
            raise ValueError(f"{key}: {exc}") from None
        if split == "train" and not records:
            raise ValueError(f"data: the train split has no prompts ({cfg.data.train_path or 'arithmetic'})")
        if tokenizer is None:
            tokenizer = _local_tokenizer(cfg)
        if tokenizer is not None:  # over-long prompts: refused now, not inside the flow with a run directory written
            src = getattr(cfg.data, f"{split}_path", None) or f"{cfg.data.dataset} {split} split"
            check_prompt_lengths(records, cfg.data, tokenizer, cfg.max_prompt_tokens(), source=src)


def _local_tokenizer(cfg: MasterConfig) -> Any:
    """The run's tokenizer when it loads from this machine (a built-in or local model, or one in
    the hub's cache), else None: the flow checks the prompts again when it has the tokenizer."""
    try:
        return load_tokenizer(cfg)
    except Exception:  # noqa: BLE001 - not loadable without the network: the flow's check stands
        return None
