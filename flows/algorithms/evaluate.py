"""Evaluation flows: one checkpoint, or a sweep over every checkpoint not yet evaluated.

``evaluate_checkpoint(run_id, checkpoint, dataset)`` answers a held-out prompt set (the run's
validation split by default, or a JSONL/Parquet/Arrow file) with the checkpoint's weights,
greedily (``accuracy``) and with ``num_samples`` samples (``pass_at_k``), and persists the
samples as Arrow under ``<run>/evals/<checkpoint>/<dataset-key>/``.

``eval_sweep(target)`` does that for every committed checkpoint of a run (``target`` = run id)
or of every run under a storage prefix (``target`` containing ``/`` or ``://``) that has no
evaluation yet, and publishes the *eval view* of the target (:mod:`flows.observe.eval_view`: per run and
dataset the checkpoints' accuracy, pass@k and links, the best one marked, text curves), a new
version of the artifact ``nrl-<target>-evals`` only when it changed: run twice, the second run
evaluates nothing new and publishes nothing. The ``eval-sweep`` deployment runs it on a cron schedule.

A sweep's flow run is named ``eval-sweep-<target>-<UTC YYYYmmdd-HHMM>`` (target: the run id or the
prefix's basename), one checkpoint's ``eval-<run_id>-<checkpoint>``; both are tagged
``run:<run_id>`` for the run they evaluate (a sweep over a prefix: the runs it evaluated anew).

Evaluating during training is safe: each evaluation claims its checkpoint
(:mod:`nrl_tasks.stages.holds`), so retention keeps it until the claim is released and two
sweeps on one run split the checkpoints instead of evaluating one twice. A checkpoint deleted
anyway (by hand, or before the claim) is skipped with a warning and listed under ``vanished``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect import flow, get_run_logger

import storage
import storage as _st
from flows.algorithms.registry import recipe_of
from flows.config import ConfigError, MasterConfig, load_config
from flows.observe.artifacts import publish_eval_table
from flows.observe.eval_view import is_prefix, target_label
from flows.observe.flow_run_meta import add_flow_run_tags, run_tag
from flows.observe.quiet_logs import quiet_lifecycle_logs
from flows.observe.trackers import open_trackers
from flows.run.ray_session import connect_ray
from flows.run.session import own_local_ray, reading_session
from flows.run.state import check_storage_root, list_runs, read_status, saved_config_data
from nrl_tasks.models.generation.interfaces import GenerationConfig
from nrl_tasks.run_layout import RunLayout, join_uri, parse_step_dir
from nrl_tasks.stages.checkpoint import is_checkpoint_committed, list_checkpoints
from nrl_tasks.stages.common import manifest_dict
from nrl_tasks.stages.data import load_prompt_file
from nrl_tasks.stages.evaluate import _eval_key, evaluate
from nrl_tasks.stages.holds import hold_checkpoint, is_deleting
from storage import fs, retry_policy

__all__ = ["MAX_RUN_TAGS", "eval_generation", "eval_sweep", "evaluate_checkpoint", "load_run_config", "tag_eval_run"]

#: ``run:<run_id>`` tags an eval flow run carries at most
MAX_RUN_TAGS = 20
#: listings of a run's checkpoints a sweep makes while checkpoints vanish before it holds them
_HOLD_ROUNDS = 3


def load_run_config(run_id: str, root: str, storage_options: dict[str, Any] | None = None) -> MasterConfig:
    """The saved config of a run, with the storage section replaced by the current one; a run
    without generation settings (DPO, SFT) is evaluated with :func:`eval_generation`'s."""
    return eval_generation(load_config(saved_config_data(run_id, root, storage_options)))


def eval_generation(cfg: MasterConfig) -> MasterConfig:
    """``cfg`` with generation settings for evaluating its checkpoints: its own, or for a run that
    has none (DPO, SFT: they train without sampling) the HF backend answering in at most a quarter
    of ``policy.max_total_sequence_length`` tokens (at most 64), greedily and sampled at
    temperature 1 for pass@k."""
    if cfg.has_generation:
        return cfg
    budget = max(1, min(64, cfg.policy.max_total_sequence_length // 4))
    return cfg.model_copy(update={"generation": GenerationConfig(backend="hf", max_new_tokens=budget)})


def _sweep_run_name() -> str:
    from datetime import datetime, timezone

    from prefect.runtime import flow_run

    target = str((flow_run.parameters or {}).get("target") or "runs")
    return f"eval-sweep-{target_label(target)}-{datetime.now(timezone.utc):%Y%m%d-%H%M}"


def tag_eval_run(run_ids: Sequence[str]) -> None:
    """Tag the current flow run ``run:<run_id>`` for each of ``run_ids``, keeping the tags it has
    (e.g. a deployment's ``nrl``, ``eval``), at most :data:`MAX_RUN_TAGS` run tags. Never raises."""
    from prefect.runtime import flow_run

    if run_ids and flow_run.id:
        add_flow_run_tags(flow_run.id, [run_tag(r) for r in run_ids], max_run_tags=MAX_RUN_TAGS)


def _run_info(root: str, run_id: str) -> dict[str, Any]:
    """What the eval view links a run by: its training flow runs (``status.json``: the latest and
    the run's history) and storage URI."""
    from prefect.settings import get_current_settings

    layout = RunLayout(root, run_id)
    try:
        status = read_status(layout) or {}
    except Exception:  # noqa: BLE001 - the view then names no flow run
        status = {}
    flow_runs = [{k: e.get(k) for k in ("attempt", "kind", "flow_run_id")} for e in status.get("history") or []]
    return {"flow_run_id": status.get("flow_run_id"), "flow_runs": flow_runs, "run_uri": layout.run_uri,
            "ui_url": get_current_settings().ui_url}


def _hold_pending(
    layout: RunLayout, dataset: str | None, out: dict[str, list[Any]], opts: dict[str, Any] | None,
) -> tuple[list[tuple[int, str]], dict[str, Any]]:
    """Hold every committed checkpoint of the run that has no evaluation on ``dataset`` yet, at once
    when listed: a run with tight retention (``keep_last_k=1``, ``save_period=1``) deletes a
    checkpoint one step after writing it, sooner than an evaluation that claims it only when its
    turn comes (after loading the prompts and starting Ray) could hold it. A checkpoint that went
    between the listing and its hold is dropped and the run listed again (a newer one has come),
    at most :data:`_HOLD_ROUNDS` times; what is still gone then is reported as vanished.
    Returns the checkpoints to evaluate, oldest first, and their holds (released by the caller)."""

    holds: dict[str, Any] = {}
    pending: dict[str, int] = {}
    seen: set[str] = set()  # evaluated already, or gone before its hold
    gone: list[str] = []
    try:
        for _ in range(_HOLD_ROUNDS):
            lost = False
            for step, ck_uri in list_checkpoints(layout.checkpoints_uri, opts):
                name = ck_uri.rstrip("/").rsplit("/", 1)[-1]
                if name in pending or name in seen:
                    continue
                seen.add(name)
                if _st.is_committed(join_uri(layout.eval_uri(name), _eval_key(dataset)), storage_options=opts):
                    out["skipped"].append(f"{layout.run_id}/{name}")
                    continue
                hold = hold_checkpoint(layout, name, opts)  # first the hold, then the check (holds.py's order)
                if is_deleting(layout, name, opts) or not is_checkpoint_committed(ck_uri, opts):
                    hold.release()
                    gone.append(name)
                    lost = True
                    continue
                holds[name], pending[name] = hold, step
            if not lost:
                break
    except BaseException:
        for hold in holds.values():
            hold.release()
        raise
    for name in gone:
        out["vanished"].append(f"{layout.run_id}/{name}")
        get_run_logger().warning("eval sweep: skipped %s/%s: deleted by retention before it could be held", layout.run_id, name)
    return sorted(((s, n) for n, s in pending.items())), holds


def _records(cfg: MasterConfig, run_id: str, dataset: str | None, max_prompts: int | None) -> list[dict[str, str]]:
    if dataset:
        recs = load_prompt_file(
            dataset, prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
            storage_options=cfg.storage.storage_options or None,
        )
    else:
        from nrl_tasks.stages.data import load_prompt_records, read_records_snapshot

        opts = cfg.storage.storage_options or None
        uri = join_uri(RunLayout(cfg.storage.root, run_id).run_uri, "data", "val")
        recs = read_records_snapshot(uri, opts)  # every field of a row (a multi-turn episode's first metadata)
        if recs is None:
            recs = load_prompt_records(cfg.data, "val", cfg.grpo.seed, opts)
    limit = max_prompts or cfg.grpo.max_val_samples
    return recs[:limit]


@flow(name="evaluate-checkpoint", flow_run_name="eval-{run_id}-{checkpoint}", validate_parameters=False, persist_result=False)
def evaluate_checkpoint(
    run_id: str,
    checkpoint: str,
    dataset: str | None = None,
    storage: str | None = None,
    num_samples: int = 4,
    max_prompts: int | None = None,
) -> dict[str, Any]:
    """Evaluate checkpoint ``checkpoint`` (e.g. ``step_000004``) of ``run_id``; returns its summary."""

    root = check_storage_root(storage or "./runs", create=False)
    tag_eval_run([run_id])
    cfg = load_run_config(run_id, root)
    check_generates(cfg, run_id)
    with reading_session(cfg):  # the retry policy; a local Ray it starts ends with it (flows.run.session)
        recs = _records(cfg, run_id, dataset, max_prompts)
        connect_ray(cfg)
        res = evaluate(cfg, run_id, checkpoint, recs, dataset=dataset, num_samples=num_samples)
    if res.get("vanished"):
        from nrl_tasks.stages.evaluate import CheckpointVanishedError

        raise CheckpointVanishedError(f"checkpoint {checkpoint} of {run_id}: {res.get('reason')}")
    if res.get("busy"):
        raise RuntimeError(f"checkpoint {checkpoint} of {run_id} is being evaluated by another process; retry later")
    step = parse_step_dir(checkpoint)
    if not res.get("skipped") and step is not None:
        report_to_trackers(cfg, run_id, [(step, res)])
    return res


def report_to_trackers(cfg: MasterConfig, run_id: str, results: Sequence[tuple[int, Mapping[str, Any]]]) -> None:
    """Evaluations (``(training step, evaluate()'s result)``) as ``eval/<name>`` points in the
    training run's own tracker runs (:mod:`flows.observe.trackers`: the same TensorBoard directory, MLflow
    run, W&B run), when its config enables any. Never raises."""
    lg = cfg.logger
    if not results or not (lg.tensorboard_enabled or lg.mlflow_enabled or lg.wandb_enabled):
        return

    names = {"eval_accuracy": "accuracy", "eval_pass_at_k": "pass_at_k", "eval_sample_reward_mean": "sample_reward_mean",
             "eval_turns_mean": "turns_mean"}
    trackers = open_trackers(cfg, run_id)
    try:
        for step, res in results:
            trackers.log_eval(step, {v: res[k] for k, v in names.items() if res.get(k) is not None})
    finally:
        trackers.close()


def _eval_rows(root: str, run_id: str, storage_options: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per committed evaluation of a run (from the manifests)."""

    layout = RunLayout(root, run_id)
    rows = []
    if not fs.exists(layout.evals_uri, storage_options=storage_options):
        return rows
    for ck in sorted(fs.list_dir(layout.evals_uri, storage_options=storage_options)):
        ck_name = ck.rstrip("/").rsplit("/", 1)[-1]
        for ds in sorted(fs.list_dir(layout.eval_uri(ck_name), storage_options=storage_options)):
            uri = join_uri(layout.eval_uri(ck_name), ds.rstrip("/").rsplit("/", 1)[-1])
            kw = {"storage_options": storage_options} if storage_options else {}
            if not storage.is_committed(uri, **kw):
                continue
            m = manifest_dict(storage.read_manifest(uri, **kw), uri)
            rows.append(
                {
                    "run_id": run_id,
                    "checkpoint": ck_name,
                    "step": parse_step_dir(ck_name),
                    "checkpoint_uri": join_uri(layout.checkpoints_uri, ck_name),
                    "dataset": m.get("dataset"),
                    "accuracy": m.get("eval_accuracy"),
                    "pass_at_k": m.get("eval_pass_at_k"),
                    "k": m.get("eval_k"),
                    "sample_reward_mean": m.get("eval_sample_reward_mean"),
                    "num_prompts": m.get("eval_num_prompts"),
                    "turns_mean": m.get("eval_turns_mean"),
                    "seconds": m.get("seconds"),
                }
            )
    return rows


@flow(name="eval-sweep", flow_run_name=_sweep_run_name, validate_parameters=False, persist_result=False)
def eval_sweep(
    target: str,
    storage: str | None = None,
    dataset: str | None = None,
    num_samples: int = 4,
    max_prompts: int | None = None,
) -> dict[str, Any]:
    """Evaluate every committed checkpoint without an evaluation, for one run or every run under a prefix.

    ``target``: a run id (looked up under ``storage``, default ``./runs``) or a storage prefix
    holding runs. Returns ``{"evaluated", "skipped", "vanished", "busy", "rows"}``: checkpoints
    evaluated now, already evaluated, gone before or during their evaluation (skipped with a
    warning; the sweep goes on), and being evaluated by a concurrent sweep (its claim is live);
    ``rows``: every committed evaluation of the runs (one per checkpoint and dataset).
    """
    if is_prefix(target):
        root = check_storage_root(target, create=False)
        run_ids = [r["run_id"] for r in list_runs(root)]
    else:
        root = check_storage_root(storage or "./runs", create=False)
        check_generates(load_run_config(target, root), target)
        run_ids = [target]
        tag_eval_run(run_ids)
    out: dict[str, list[Any]] = {"evaluated": [], "skipped": [], "vanished": [], "busy": [], "rows": []}
    try:
        # one local Ray for the sweep, stopped at its end (flows.run.session); logs as quiet as a training run's
        with own_local_ray(), quiet_lifecycle_logs():
            for run_id in run_ids:
                out["rows"].extend(_sweep_run(root, run_id, dataset, num_samples, max_prompts, out))
    finally:  # the runs with new evaluations, also when a later one failed
        tag_eval_run([c.split("/", 1)[0] for c in out["evaluated"]])
    published = False
    if out["rows"]:
        label = target_label(root if is_prefix(target) else target)
        published = publish_eval_table(label, out["rows"], {r: _run_info(root, r) for r in run_ids})
    get_run_logger().info(
        "eval sweep: %d evaluated, %d already evaluated, %d vanished, %d being evaluated elsewhere; eval view %s",
        *(len(out[k]) for k in ("evaluated", "skipped", "vanished", "busy")), "published" if published else "not republished",
    )
    return out


def _sweep_run(
    root: str, run_id: str, dataset: str | None, num_samples: int, max_prompts: int | None, out: dict[str, list[Any]],
) -> list[dict[str, Any]]:
    """Evaluate the checkpoints of one run that have no evaluation (each ``run/checkpoint`` appended
    to its outcome's list in ``out``); return the run's rows."""
    cfg = load_run_config(run_id, root)
    if recipe_of(cfg).product != "policy":  # a prefix's reward-model runs: nothing to generate with
        get_run_logger().info("eval sweep: run %s trains a reward model: not evaluated (its validation is its "
                              "held-out pair accuracy)", run_id)
        return []
    with retry_policy(cfg.storage.retry.policy()):  # the run's storage retry policy, as its own flows apply it
        return _sweep_checkpoints(cfg, root, run_id, dataset, num_samples, max_prompts, out)


def check_generates(cfg: MasterConfig, run_id: str) -> None:
    """``ConfigError`` for a run whose checkpoints are not a policy (a reward model: ``nrl rm``):
    an evaluation generates answers with them."""
    recipe = recipe_of(cfg)
    if recipe.product != "policy":
        raise ConfigError(f"run {run_id!r} ({recipe.kind}) trains a reward model: its checkpoints answer no prompts, which "
                          f"an evaluation asks of them; its held-out pair accuracy is the run's validation "
                          f"({recipe.section}.val_period, {recipe.section}.val_at_end: val_accuracy in metrics.jsonl)")


def _sweep_checkpoints(
    cfg: MasterConfig, root: str, run_id: str, dataset: str | None, num_samples: int, max_prompts: int | None,
    out: dict[str, list[Any]],
) -> list[dict[str, Any]]:
    logger = get_run_logger()
    layout = RunLayout(root, run_id)
    recs = None
    done: list[tuple[int, Mapping[str, Any]]] = []
    pending, holds = _hold_pending(layout, dataset, out, cfg.storage.storage_options or None)
    try:
        for _step, name in pending:
            label_ck = f"{run_id}/{name}"
            recs = recs if recs is not None else _records(cfg, run_id, dataset, max_prompts)
            connect_ray(cfg)
            try:
                res = evaluate(cfg, run_id, name, recs, dataset=dataset, num_samples=num_samples)
            finally:
                holds.pop(name).release()  # evaluated (or not): retention may have it from here
            if res.get("vanished"):
                out["vanished"].append(label_ck)
                logger.warning("eval sweep: skipped %s: the checkpoint vanished (%s)", label_ck, res.get("reason"))
            elif res.get("busy"):
                out["busy"].append(label_ck)
                logger.info("eval sweep: skipped %s: another evaluation of it is running", label_ck)
            elif res.get("skipped"):
                out["skipped"].append(label_ck)  # committed by another sweep meanwhile
            else:
                out["evaluated"].append(label_ck)
                done.append((_step, res))
                logger.info("evaluated %s: accuracy %s pass@k %s", label_ck, res.get("eval_accuracy"), res.get("eval_pass_at_k"))
    finally:
        for hold in holds.values():
            hold.release()
    report_to_trackers(cfg, run_id, done)
    return _eval_rows(root, run_id, None)
