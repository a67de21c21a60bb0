"""A run's id and its resolved config: what every flow (GRPO, DPO, the SFT warm start) and the CLI
decide before a run starts."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from flows.config import ConfigError, MasterConfig, load_config
from flows.config.overrides import check_overrides_apply
from flows.run.state import check_storage_root, saved_config_data
from nrl_tasks.run_layout import RunLayout, validate_run_id

__all__ = ["check_run_kind", "new_run_id", "resolve_config"]


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


def check_run_kind(cfg: MasterConfig, algorithm: str, source: str) -> None:
    """``ConfigError`` when ``cfg`` (from ``source``: a config file or a run) is not a config of
    ``algorithm``: a ``dpo`` section makes a DPO run, which ``nrl grpo`` would train as GRPO,
    ignoring the section."""
    if algorithm == "grpo" and cfg.dpo is not None:
        raise ConfigError(f"{source}: has a `dpo` section: a DPO config (use `nrl dpo`; `nrl grpo` would ignore it)")
    if algorithm == "dpo" and cfg.dpo is None:
        raise ConfigError(f"{source}: no `dpo` section (a GRPO config: use `nrl grpo`)")


def resolve_config(
    config: Any,
    overrides: list[str] | None = None,
    storage: str | None = None,
    *,
    run_id: str | None = None,
    algorithm: str | None = None,
) -> MasterConfig:
    """Validated config with overrides and an explicit storage root applied (normalised).

    ``config=None`` with a ``run_id`` loads that run's saved ``config.yaml`` (resume); the run's
    kind (``"dpo"`` when it has a ``dpo`` section, else ``"grpo"``) is then the run's own.
    ``algorithm`` (``"grpo"``/``"dpo"``; a resume's is the run's): ``ConfigError`` for an override
    of a section that kind never reads (:func:`flows.config.overrides.check_overrides_apply`) and
    for a config of the other kind (:func:`check_run_kind`).
    """
    resuming = config is None and bool(run_id)
    source = str(config) if isinstance(config, (str, os.PathLike)) else "the config"
    if resuming:  # the run must exist: nothing is created
        root = check_storage_root(storage or "./runs", create=False)
        config = saved_config_data(validate_run_id(run_id), root)
        kind = "dpo" if config.get("dpo") is not None else "grpo"
        if algorithm is not None and algorithm != kind:
            raise ConfigError(f"run {run_id!r} is a {kind.upper()} run: resume it with `nrl resume {run_id}`")
        algorithm, source = kind, f"run {run_id!r}"
    if algorithm is not None:
        try:
            check_overrides_apply(overrides or [], algorithm)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    cfg = load_config(config, overrides or [], name=RunLayout(root, run_id).config_uri if resuming else None)
    if algorithm is not None:
        check_run_kind(cfg, algorithm, source)
    if storage:
        cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"root": storage})})
    root = check_storage_root(cfg.storage.root, cfg.storage.storage_options or None, create=not resuming)
    return cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"root": root})})
