"""A run's id and its resolved config: what every flow and the CLI decide before a run starts."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, Protocol

from flows.config import ConfigError, MasterConfig, load_config
from flows.config.overrides import check_overrides_apply
from flows.run.state import check_storage_root, saved_config_data
from nrl_tasks.config.master import ALGORITHM_SECTIONS, config_kind, section_of
from nrl_tasks.run_layout import RunLayout, validate_run_id

__all__ = ["RunKind", "check_run_kind", "new_run_id", "resolve_config"]


def new_run_id(prefix: str = "grpo") -> str:
    """A fresh run id. Inside a flow run it is derived from the flow-run id only
    (``grpo-<12 hex>``), so ``prefect flow-run retry`` of a run started without a run id finds
    the same run; outside, ``grpo-YYYYmmdd-HHMMSS-<6 hex>``."""
    try:
        from prefect.runtime import flow_run

        fid = flow_run.id
    except Exception:  # noqa: BLE001
        fid = None
    if fid:
        return f"{prefix}-{str(fid).replace('-', '')[:12]}"
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


class RunKind(Protocol):
    """What resolving a config needs of a run's algorithm (its recipe, :class:`flows.run.recipe.Recipe`)."""

    kind: str
    unread_sections: tuple[str, ...]


def check_run_kind(cfg: MasterConfig, kind: str, source: str) -> None:
    """``ConfigError`` when ``cfg`` (from ``source``: a config file or a run) is not a config of
    ``kind`` (:attr:`MasterConfig.kind`): e.g. a ``dpo`` section makes a DPO run, which ``nrl grpo``
    would train as GRPO, ignoring the section."""
    have = cfg.kind
    if have == kind:
        return
    if section_of(have) in ALGORITHM_SECTIONS:
        raise ConfigError(f"{source}: has a `{section_of(have)}` section: a {have.upper()} config (use `nrl {have}`; "
                          f"`nrl {kind}` would ignore it)")
    if section_of(kind) in ALGORITHM_SECTIONS:
        raise ConfigError(f"{source}: no `{section_of(kind)}` section (a {have.upper()} config: use `nrl {have}`)")
    raise ConfigError(f"{source}: a config of algorithm {have!r}, not {kind!r}")


def resolve_config(
    config: Any,
    overrides: list[str] | None = None,
    storage: str | None = None,
    *,
    run_id: str | None = None,
    recipe: RunKind | None = None,
) -> MasterConfig:
    """Validated config with overrides and an explicit storage root applied (normalised).

    ``config=None`` with a ``run_id`` loads that run's saved ``config.yaml`` (resume).
    ``recipe`` (the run's algorithm; a resume's must be the run's own): ``ConfigError`` for an
    override of a section that kind never reads (:func:`flows.config.overrides.check_overrides_apply`)
    and for a config of another kind (:func:`check_run_kind`).
    """
    resuming = config is None and bool(run_id)
    source = str(config) if isinstance(config, (str, os.PathLike)) else "the config"
    if resuming:  # the run must exist: nothing is created
        root = check_storage_root(storage or "./runs", create=False)
        config = saved_config_data(validate_run_id(run_id), root)
        kind = config_kind(config)
        if recipe is not None and recipe.kind != kind:
            raise ConfigError(f"run {run_id!r} is a {kind.upper()} run: resume it with `nrl resume {run_id}`")
        source = f"run {run_id!r}"
    if recipe is not None:
        try:
            check_overrides_apply(overrides or [], recipe.kind, recipe.unread_sections)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    cfg = load_config(config, overrides or [], name=RunLayout(root, run_id).config_uri if resuming else None)
    if recipe is not None:
        check_run_kind(cfg, recipe.kind, source)
    if storage:
        cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"root": storage})})
    root = check_storage_root(cfg.storage.root, cfg.storage.storage_options or None, create=not resuming)
    return cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"root": root})})
