"""The GRPO flow: generate → score → logprob → advantages → train → refit, step after step.

``grpo(config, run_id=None, resume=False)`` sets up (or re-attaches to) the run's Ray actors and
loops steps. Every stage persists its output under ``<storage>/<run_id>/steps/step_N/`` and is
idempotent, so a resumed flow (``resume=True``, ``nrl resume RUN_ID`` or ``prefect flow-run
retry``) recomputes nothing that is committed. When the Policy actors are gone (a local Ray dies
with the flow process) or hold other weights than the run's trained prefix, the last checkpoint
is restored and the ``train`` stages after it are *replayed* from their persisted batches (no
regeneration). Every resume then starts the generation side with a full refit.

Without a Ray address the flow starts its own local Ray and stops it when it ends, completed or
failed (``NRL_KEEP_ACTORS=1`` keeps it); ``status.json`` records the flow process and that Ray's
session, so a resume first stops what a SIGKILLed predecessor left of it (:mod:`flows.run_process`).

Stages that call actors run with the run's ``grpo.stage_retries`` / ``grpo.stage_retry_delay_s``
(retried on actor faults only), the refit with ``grpo.refit.retries`` / ``grpo.refit.retry_delay_s``.

Per step: one line in ``metrics.jsonl``, a Prefect table artifact of all lines, a progress
artifact, a markdown artifact with the best and worst rollouts, a console line; the flow run is
renamed ``<run_id>-step<N>`` as it goes.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from prefect import flow, get_run_logger

from flows.artifacts import BackgroundPublisher, ProgressHandle, publish_metrics_table, publish_rollouts, rollouts_markdown
from flows.config import MasterConfig, load_config
from flows.metrics import build_step_metrics, format_console_line, read_metrics, upsert_metrics
from flows.run_layout import RunLayout, validate_run_id
from flows.recompute import apply_recompute, check_resume_data
from flows.retention import RetentionPolicy, apply_retention
from flows.run_state import (
    check_storage_root,
    init_run,
    parse_recompute,
    read_status,
    saved_config_data,
    trained_prefix,
    write_status,
)
from flows.run_process import current_process, reap_local_ray, this_host
from flows.runtime import Runtime, ray_connected, setup_runtime, shutdown_local_ray, shutdown_runtime

__all__ = ["grpo", "new_run_id", "resolve_config", "run_grpo_steps"]


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
    if config is None and run_id:
        root = check_storage_root(storage or "./runs")
        config = saved_config_data(validate_run_id(run_id), root)
    cfg = load_config(config, overrides or [])
    if storage:
        cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"root": storage})})
    root = check_storage_root(cfg.storage.root, cfg.storage.storage_options or None)
    return cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"root": root})})


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    rid = params.get("run_id") or new_run_id()
    return f"{rid}-resume" if params.get("resume") else str(rid)


def _rename_flow_run(name: str) -> None:
    try:
        from prefect.client.orchestration import get_client
        from prefect.runtime import flow_run

        fid = flow_run.id
        if not fid:
            return
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run_id=uuid.UUID(str(fid)), name=name)
    except Exception as exc:  # noqa: BLE001 - cosmetic
        get_run_logger().debug("flow-run rename failed: %s", exc)


# ----------------------------------------------------------------------------------------------
# restoring the trained state


def restore_policy_state(rt: Runtime, cfg: MasterConfig, last_trained: int, logger: Any) -> dict[str, Any]:
    """Make the policy hold the weights after step ``last_trained`` (restore + replay if needed).

    Attached live actors are kept when every rank answers and holds exactly those weights
    (version and the checksum recorded by that ``train``); otherwise, and always for actors just
    created, the newest checkpoint at or before ``last_trained`` is restored and the ``train``
    stages after it are replayed from their persisted batches. A replayed step whose datasets
    are missing (``--recompute``) gets them recomputed first; the replay must reproduce the
    recorded checksum (:mod:`nrl_tasks.stages.recovery`).
    """
    from flows.recompute import resume_window
    from nrl_tasks.stages.recovery import ensure_policy, missing_datasets, restore_policy

    anchor, _ = resume_window(rt.layout, rt.storage_options)
    repair = [s for s in range(anchor + 1, last_trained + 1) if missing_datasets(rt, s)]
    if rt.policy_attached and not repair:
        out = ensure_policy(rt, cfg, last_trained, logger, verify=True)
        if out["restored_from"] == "live":
            logger.info("attached to live policy actors at weights version %d", last_trained)
        return out
    if repair:
        logger.info("steps %s lack datasets: restoring and replaying to recompute them", repair)
    return restore_policy(rt, cfg, last_trained, logger, fresh=not rt.policy_attached)


# ----------------------------------------------------------------------------------------------
# one step


def _due(period: int, step: int, last: int) -> bool:
    return step % period == 0 or step == last


def _rollout_sample(rt: Runtime, step: int, n: int, rewards: list[float]) -> str | None:
    import storage

    if n <= 0:
        return None
    r = storage.load_batch(rt.layout.stage_uri(step, "rollouts"), columns=["prompt", "response", "answer"], **rt.storage_kw)
    return rollouts_markdown(rt.run_id, step, r["prompt"], r["response"], r["answer"], rewards, n=n)


def finish_step(
    rt: Runtime,
    cfg: MasterConfig,
    step: int,
    manifests: dict[str, Any],
    *,
    chash: str,
    max_steps: int,
    force_refit: bool,
    t_start: float,
    progress: ProgressHandle,
    publisher: BackgroundPublisher,
    write_line: bool = True,
) -> dict[str, Any]:
    """Checkpoint (if due), refit, validate (if due), then the metrics line and artifacts."""
    from nrl_tasks.stages.checkpoint import checkpoint
    from nrl_tasks.stages.evaluate import validate
    from nrl_tasks.stages.recovery import with_stage_retries
    from nrl_tasks.stages.refit import refit

    logger = get_run_logger()
    ck = None
    if cfg.checkpointing.enabled and _due(cfg.checkpointing.save_period, step, max_steps):
        ck = with_stage_retries(checkpoint, cfg)(cfg, rt.run_id, step, chash)
    rcfg = cfg.grpo.refit
    ref = refit.with_options(retries=rcfg.retries, retry_delay_seconds=rcfg.retry_delay_s)(
        cfg, rt.run_id, step, force=force_refit, step=step
    )
    val = None
    if cfg.grpo.val_period and step % cfg.grpo.val_period == 0:
        val = with_stage_retries(validate, cfg)(cfg, rt.run_id, step, step)
    row = None
    if write_line:
        import storage

        rw = storage.load_batch(rt.layout.stage_uri(step, "rewards"), columns=["rewards", "reward_valid"], **rt.storage_kw)
        row = build_step_metrics(
            step, manifests, refit=ref, val=val, checkpoint=ck, wall_seconds=time.perf_counter() - t_start,
            rewards=(rw["rewards"], rw["reward_valid"]),
        )
        rows = upsert_metrics(rt.layout.metrics_uri, row, rt.storage_options)
        if cfg.logger.artifacts:
            publisher.submit(publish_metrics_table, rt.run_id, rows)
            md = _rollout_sample(rt, step, cfg.logger.num_rollouts_to_show, rw["rewards"].tolist())
            if md:
                publisher.submit(publish_rollouts, rt.run_id, md)
        line = format_console_line(rt.run_id, row, max_steps)
        logger.info(line)
        if cfg.logger.console:
            print(line, flush=True)
    if cfg.logger.artifacts:
        publisher.submit(progress.update, step, max_steps)
    return {"checkpoint": ck, "refit": ref, "val": val, "metrics": row}


def run_one_step(rt: Runtime, cfg: MasterConfig, step: int) -> dict[str, Any]:
    """The data stages of one step (prompts → ... → train); returns their manifests."""
    from nrl_tasks.stages.advantages import advantages
    from nrl_tasks.stages.common import committed
    from nrl_tasks.stages.generate import generate
    from nrl_tasks.stages.logprob import logprob
    from nrl_tasks.stages.recovery import with_stage_retries
    from nrl_tasks.stages.score import score
    from nrl_tasks.stages.train import replay_train, train

    v = step - 1
    m: dict[str, Any] = {}
    m["rollouts"] = with_stage_retries(generate, cfg)(cfg, rt.run_id, step, v)
    m["prompts"] = committed(rt.layout.stage_uri(step, "prompts"), rt.storage_options)
    if m["rollouts"].get("weights_version") not in (None, v):
        raise RuntimeError(
            f"step {step}: committed rollouts were generated on weights version {m['rollouts']['weights_version']}, "
            f"expected {v}; recompute them with --recompute generate@{step}"
        )
    m["rewards"] = score(cfg, rt.run_id, step)
    m["logprobs"] = with_stage_retries(logprob, cfg)(cfg, rt.run_id, step, v)
    m["advantages"] = advantages(cfg, rt.run_id, step)
    done = committed(rt.layout.stage_uri(step, "train"), rt.storage_options)
    if done is not None and rt.policy.weights_version == v:
        replay_train(rt, cfg, step)  # trained earlier (e.g. before a --recompute of this step)
        m["train"] = done
    else:
        m["train"] = with_stage_retries(train, cfg)(cfg, rt.run_id, step)
    return m


def run_grpo_steps(rt: Runtime, cfg: MasterConfig, *, chash: str, resume: bool) -> dict[str, Any]:
    """Restore, then loop the steps of a run (the body of the flow)."""
    progress = ProgressHandle(rt.run_id)
    publisher = BackgroundPublisher()
    try:
        return _loop(rt, cfg, chash=chash, resume=resume, progress=progress, publisher=publisher)
    finally:
        publisher.close()


def _loop(
    rt: Runtime, cfg: MasterConfig, *, chash: str, resume: bool, progress: ProgressHandle, publisher: BackgroundPublisher
) -> dict[str, Any]:
    from nrl_tasks.stages.common import committed
    from nrl_tasks.stages.evaluate import validate
    from nrl_tasks.stages.recovery import with_stage_retries
    from nrl_tasks.stages.refit import refit

    logger = get_run_logger()
    layout, opts = rt.layout, rt.storage_options
    max_steps = cfg.grpo.max_num_steps
    last = trained_prefix(layout, storage_options=opts)
    if last > max_steps:
        last = max_steps
    restored = restore_policy_state(rt, cfg, last, logger)
    force = bool(resume or last > 0 or rt.generation_attached)
    retention = RetentionPolicy.from_config(cfg)  # never deletes what a resume reads
    if last > 0:
        have_line = any(int(r["step"]) == last for r in read_metrics(layout.metrics_uri, opts))
        manifests = {s: committed(layout.stage_uri(last, s), opts) for s in ("prompts", "rollouts", "rewards", "logprobs", "advantages", "train")}
        finish_step(
            rt, cfg, last, manifests, chash=chash, max_steps=max_steps, force_refit=True,
            t_start=time.perf_counter(), progress=progress, publisher=publisher, write_line=not have_line,
        )
        apply_retention(layout, retention, last, opts)
    elif force:
        rcfg = cfg.grpo.refit
        refit.with_options(retries=rcfg.retries, retry_delay_seconds=rcfg.retry_delay_s)(cfg, rt.run_id, 0, force=True, step=0)
    if last == 0 and cfg.grpo.val_at_start and cfg.grpo.val_period:
        with_stage_retries(validate, cfg)(cfg, rt.run_id, 0, 0)
    step_wall: list[float] = []
    for step in range(last + 1, max_steps + 1):
        t0 = time.perf_counter()
        publisher.submit(_rename_flow_run, f"{rt.run_id}-step{step:04d}")
        manifests = run_one_step(rt, cfg, step)
        finish_step(
            rt, cfg, step, manifests, chash=chash, max_steps=max_steps, force_refit=False,
            t_start=t0, progress=progress, publisher=publisher,
        )
        apply_retention(layout, retention, step, opts)
        step_wall.append(time.perf_counter() - t0)
    return {"restored": restored, "first_step": last + 1, "step_wall_s": step_wall}


@flow(name="grpo", flow_run_name=_flow_run_name, validate_parameters=False, persist_result=False)
def grpo(
    config: str | dict | None = None,
    run_id: str | None = None,
    resume: bool = False,
    overrides: list[str] | None = None,
    storage: str | None = None,
    recompute: list[str] | None = None,
) -> dict[str, Any]:
    """Train with GRPO. ``config``: YAML path, dict or ``MasterConfig``; ``overrides``: ``key=value``.

    Returns ``{"run_id", "run_uri", "last_step", "metrics_uri", "checkpoints", "final_metrics"}``.
    """
    from prefect.runtime import flow_run

    logger = get_run_logger()
    cfg = resolve_config(config, overrides, storage, run_id=run_id if resume else None)
    run_id = validate_run_id(run_id) if run_id else new_run_id()
    specs = parse_recompute(recompute)
    if specs and not resume:
        raise ValueError("recompute needs resume=True")
    layout = RunLayout(cfg.storage.root, run_id)
    opts = cfg.storage.storage_options or None
    fid = str(flow_run.id) if flow_run.id else None
    chash = init_run(layout, cfg, resume=resume, flow_run_id=fid)
    if specs:
        deleted = apply_recompute(layout, specs, opts)
        logger.info("recompute %s: deleted %s", recompute, deleted)
    check_resume_data(layout, opts)  # damaged batches a resume would read: one clear error, nothing started
    reaped = reap_local_ray(read_status(layout, opts) or {})  # a crashed earlier flow's local Ray
    if reaped:
        logger.warning("stopped %d leftover process(es) of the previous flow's local Ray: %s", len(reaped), ", ".join(reaped))
    write_status(
        layout, opts, status="running", flow_run_id=fid, max_steps=cfg.grpo.max_num_steps, config_hash=chash,
        error=None, flow_process=current_process(), local_ray=None,
    )
    logger.info("run %s at %s (config hash %s, resume=%s)", run_id, layout.run_uri, chash, resume)
    keep = os.environ.get("NRL_KEEP_ACTORS", "0") == "1"
    own_ray = not ray_connected()  # a local Ray started by this flow is stopped when it ends, failed or not

    def record_ray(rt: Runtime) -> None:
        if rt.ray_session_dir:
            write_status(layout, opts, local_ray={"host": this_host(), "session_dir": rt.ray_session_dir})

    try:
        rt = setup_runtime(cfg, run_id, on_connect=record_ray)
        info = run_grpo_steps(rt, cfg, chash=chash, resume=resume)
        rows = read_metrics(layout.metrics_uri, opts)
        write_status(layout, opts, status="completed", last_step=cfg.grpo.max_num_steps)
        if not keep:
            shutdown_runtime(run_id)
    except BaseException as exc:
        write_status(layout, opts, status="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
        raise
    finally:
        if own_ray and not keep:
            shutdown_local_ray(run_id)
    from nrl_tasks.stages.checkpoint import list_checkpoints

    return {
        "run_id": run_id,
        "run_uri": layout.run_uri,
        "last_step": cfg.grpo.max_num_steps,
        "metrics_uri": layout.metrics_uri,
        "checkpoints": [u for _, u in list_checkpoints(layout.checkpoints_uri, opts)],
        "final_metrics": rows[-1] if rows else None,
        **info,
    }
