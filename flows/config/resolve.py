"""A run's id and its resolved config: what every flow (GRPO, DPO, the SFT warm start) and the CLI
decide before a run starts."""

from __future__ import annotations

import time
import uuid
from typing import Any

from flows.config import MasterConfig, load_config
from flows.run.state import check_storage_root, saved_config_data
from nrl_tasks.run_layout import RunLayout, validate_run_id

__all__ = ["new_run_id", "resolve_config"]


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


def resolve_config(
    config: Any,
    overrides: list[str] | None = None,
    storage: str | None = None,
    *,
    run_id: str | None = None,
) -> MasterConfig:
    """Validated config with overrides and an explicit storage root applied (normalised).

    ``config=None`` with a ``run_id`` loads that run's saved ``config.yaml`` (resume).
    """
    resuming = config is None and bool(run_id)
    if resuming:  # the run must exist: nothing is created
        root = check_storage_root(storage or "./runs", create=False)
        config = saved_config_data(validate_run_id(run_id), root)
    cfg = load_config(config, overrides or [], name=RunLayout(root, run_id).config_uri if resuming else None)
    if storage:
        cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"root": storage})})
    root = check_storage_root(cfg.storage.root, cfg.storage.storage_options or None, create=not resuming)
    return cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"root": root})})
