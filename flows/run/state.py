"""A run's persistent state on storage: creation, config-hash check, status, trained steps.

- ``config.yaml`` is written once when the run is created (credentials redacted, hash inside);
  a resume with a different config hash is refused with both hashes in the message.
- ``status.json`` (``status``: running | completed | interrupted | failed, ``algorithm``: grpo | dpo | sft, ``last_step``, ``flow_run_id``,
  ``updated_unix``, ``error``, ``flow_process``: host/pid/start time of the flow process,
  ``local_ray``: the session directory of a local Ray it started) feeds ``nrl runs``, which
  shows a ``running`` run whose flow process is gone as crashed (:mod:`flows.run.process`).
- The *trained prefix* is the longest run of steps ``1..k`` whose ``train`` output is
  committed; ``k`` is the data cursor.
"""

from __future__ import annotations

import json
import time
from typing import Any

import storage
from flows.config import (
    ConfigError,
    MasterConfig,
    changed_keys,
    config_hash,
    config_to_yaml,
    load_config,
    load_config_text,
    saved_config_hash,
)
from flows.config.io import load_yaml_text
from flows.config.storage_root import check_storage_root, normalize_root  # noqa: F401 - kept importable here
from flows.run.hints import from_deployment, resume_command
from flows.run.lease import live_holder, resume_refusal
from flows.run.process import describe_status
from nrl_tasks.run_layout import RunLayout, parse_step_dir
from storage import fs
from storage.lease import LeaseUnreadableError

__all__ = [
    "check_new_run",
    "check_storage_root",
    "init_run",
    "list_runs",
    "read_status",
    "trained_prefix",
    "write_status",
]


def _fs():
    return fs


def _opts(cfg: MasterConfig) -> dict[str, Any] | None:
    return cfg.storage.storage_options or None


def read_status(layout: RunLayout, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    fs = _fs()
    if not fs.exists(layout.status_uri, storage_options=storage_options):
        return None
    try:
        return json.loads(fs.read_text(layout.status_uri, storage_options=storage_options))
    except (ValueError, OSError):
        return None


def write_status(layout: RunLayout, storage_options: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into ``status.json`` (atomic rewrite)."""
    cur = read_status(layout, storage_options) or {"run_id": layout.run_id}
    cur.update(fields, updated_unix=time.time())
    _fs().write_text_atomic(layout.status_uri, json.dumps(cur, indent=2, sort_keys=True), storage_options=storage_options)
    return cur


def _how_to_resume(run_id: str) -> str:
    """What to do about an existing run id, in the words of where the flow was started (:mod:`flows.run.hints`)."""

    if from_deployment():
        return f"continue it with {resume_command(run_id, deployed=True)}, or pass another run_id"
    return f"resume it (nrl resume {run_id}) or pick another --run-id"


def check_new_run(layout: RunLayout, storage_options: dict[str, Any] | None, flow_run_id: str | None) -> None:
    """``ConfigError`` when a new run's id exists, unless it is the same Prefect flow run retrying
    (its ``status.json`` names this flow run)."""
    if not _fs().exists(layout.config_uri, storage_options=storage_options):
        return
    status = read_status(layout, storage_options) or {}
    if not (flow_run_id and status.get("flow_run_id") == flow_run_id):
        raise ConfigError(f"run {layout.run_id!r} already exists under {layout.root!r}: {_how_to_resume(layout.run_id)}")


def init_run(layout: RunLayout, cfg: MasterConfig, *, resume: bool, flow_run_id: str | None = None) -> str:
    """Create the run (write ``config.yaml``) or check it for resume; return the config hash.

    A new run whose id exists is refused unless it is the same Prefect flow run retrying
    (``prefect flow-run retry``), which resumes.
    """
    fs = _fs()
    opts = _opts(cfg)
    h = config_hash(cfg)
    exists = fs.exists(layout.config_uri, storage_options=opts)
    if exists:
        if not resume:
            check_new_run(layout, opts, flow_run_id)
        check_config_hash(layout, cfg)
        return h
    if resume:
        raise ConfigError(f"cannot resume run {layout.run_id!r}: no {layout.config_uri} (nothing to resume)")
    fs.write_text_atomic(layout.config_uri, config_to_yaml(cfg), storage_options=opts)
    return h


def check_config_hash(layout: RunLayout, cfg: MasterConfig) -> str:
    """Raise ``ConfigError`` unless ``cfg`` hashes like the run's saved ``config.yaml``."""
    fs = _fs()
    opts = _opts(cfg)
    h = config_hash(cfg)
    if not fs.exists(layout.config_uri, storage_options=opts):
        raise ConfigError(f"cannot resume run {layout.run_id!r}: no {layout.config_uri} (nothing to resume)")
    text = fs.read_text(layout.config_uri, storage_options=opts)
    saved = saved_config_hash(text, layout.config_uri)
    if saved != h:
        raise ConfigError(
            f"config hash mismatch for run {layout.run_id!r}: the run was created with {saved}, "
            f"this config hashes to {h}{_changed(text, cfg, layout.config_uri)}; resume with the run's own config.yaml "
            "(only storage, logger, cluster.ray, grpo.max_num_steps, grpo.refit and checkpoint cadence may change)"
        )
    return h


def _changed(saved_text: str, cfg: MasterConfig, source: str) -> str:
    """``" (changed: a.b, c.d)"``: the keys ``cfg`` changes against a saved config text ("" if unknown)."""

    try:
        data = load_yaml_text(saved_text, source)
        data.pop("config_hash", None)
        keys = changed_keys(load_config(data), cfg)
    except (ValueError, TypeError):  # a saved config of an older layout: the hashes say enough
        return ""
    return f" (changed: {', '.join(keys[:12])}{' ...' if len(keys) > 12 else ''})" if keys else ""


def trained_prefix(layout: RunLayout, max_step: int | None = None, storage_options: dict[str, Any] | None = None) -> int:
    """Largest ``k`` such that the ``train`` output of every step ``1..k`` is committed."""

    kw = {"storage_options": storage_options} if storage_options else {}
    k = 0
    while max_step is None or k < max_step:
        if not storage.is_committed(layout.stage_uri(k + 1, "train"), **kw):
            break
        k += 1
    return k


def list_runs(root: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Runs under ``root``: ``[{run_id, status, state, last_step, max_steps, updated_unix, ...}]``.

    ``status`` is the stored one; ``state`` the same checked against the flow process
    (:func:`flows.run.process.describe_status`, e.g. ``crashed (flow process 123 on h is gone)``),
    and ``running`` whenever the run's lease is live (:func:`flows.run.lease.live_holder`), whatever
    ``status.json`` says; ``writer`` then names the holder. A run whose lease file cannot be read
    (:class:`storage.lease.LeaseUnreadableError`) is ``lease unreadable (<stored state>)``, with
    ``lease_error`` naming the file and the way on; the other runs are listed as usual.
    """

    fs = _fs()
    if not fs.exists(root, storage_options=storage_options):
        return []
    out = []
    for entry in fs.list_dir(root, storage_options=storage_options):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        try:
            layout = RunLayout(root, name)
        except ValueError:
            continue
        if not fs.exists(layout.config_uri, storage_options=storage_options):
            continue
        status = read_status(layout, storage_options) or {}
        last = trained_prefix(layout, storage_options=storage_options)
        if status.get("algorithm") == "sft":  # an SFT warm start persists no step datasets
            last = int(status.get("last_step") or 0)
        holder, lease_error, state = None, None, describe_status(status)
        try:
            holder = live_holder(layout, storage_options)
        except LeaseUnreadableError:
            lease_error, state = resume_refusal(layout, storage_options), f"lease unreadable ({state})"
        out.append(
            {
                "run_id": name,
                "status": status.get("status", "unknown"),
                "state": "running" if holder is not None else state,
                "writer": holder.describe() if holder is not None else None,
                "lease_error": lease_error,
                "last_step": last,
                "max_steps": status.get("max_steps"),
                "updated_unix": status.get("updated_unix"),
                "flow_run_id": status.get("flow_run_id"),
            }
        )
    return sorted(out, key=lambda r: r.get("updated_unix") or 0)


def existing_steps(layout: RunLayout, storage_options: dict[str, Any] | None = None) -> list[int]:
    fs = _fs()
    if not fs.exists(layout.steps_uri, storage_options=storage_options):
        return []
    steps = [parse_step_dir(e.rstrip("/").rsplit("/", 1)[-1]) for e in fs.list_dir(layout.steps_uri, storage_options=storage_options)]
    return sorted(s for s in steps if s is not None)


def saved_config_data(run_id: str, root: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The saved ``config.yaml`` of a run as a dict, storage section replaced by ``root``.

    (The saved storage options are redacted; the current ones, or the AWS environment, apply.)
    """
    fs = _fs()
    layout = RunLayout(root, run_id)
    if not fs.exists(layout.config_uri, storage_options=storage_options):
        raise ConfigError(f"no run {run_id!r} under {root!r} (missing {layout.config_uri})")
    data = load_config_text(fs.read_text(layout.config_uri, storage_options=storage_options), layout.config_uri)
    data["storage"] = {**(data.get("storage") or {}), "root": root, "storage_options": storage_options or {}}
    return data
