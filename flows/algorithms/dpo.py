"""``nrl dpo``: Direct Preference Optimization on preference pairs, as a Prefect flow.

A config with a ``dpo`` section (:mod:`nrl_tasks.config.dpo`) is a DPO run. Each step::

    pairs = preference_pairs(ctx)                  # nrl_tasks.stages.dpo
    reference = reference_logprobs(ctx, pairs)
    trained = dpo_train(ctx, pairs, reference)
    checkpoint(ctx, trained)                       # every checkpointing.save_period steps, and the last

then its ``metrics.jsonl`` line (loss, accuracy, reward margin, chosen/rejected rewards, grad
norm, stage seconds), console line and artifacts (the metrics table, progress), as for GRPO. The
run keeps GRPO's layout, ``config.yaml`` and hash check, lease and ``status.json``, so ``nrl runs``
lists it and ``nrl resume`` continues it.

**Resume** (``resume=True``): the trained prefix ``T`` is the last step before the first one
without a committed ``train``; the anchor is the newest checkpoint at or before ``T`` whose files
check out (else the initial weights). The policy is created fresh, restored from the anchor, and
steps ``anchor+1 .. T`` are replayed from their persisted ``pairs`` and ``reference``, each checked
against its recorded weights checksum; the run then goes on at ``T + 1`` (stages whose outputs
are committed skip). DPO draws nothing at random, so the resumed run's weights equal the
uninterrupted run's bit for bit. Damaged datasets the resume reads are found before it starts
(:func:`flows.run.start.plan_start`): the frozen pairs and a step's ``pairs`` and ``reference``
are deleted and made again (the same bytes; a replayed step makes its own before its ``train``),
a damaged ``train`` stops the resume with the file named.

Left out (a GRPO run has them): in-run recovery from actor faults (an actor fault fails the
run; resume continues it), retention, validation.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.utilities.annotations import quote

from flows.observe.artifacts import BackgroundPublisher, RunArtifacts, metrics_table
from flows.config import MasterConfig
from flows.config.resolve import new_run_id, resolve_config
from flows.observe.metrics import read_metrics, upsert_metrics
from flows.observe.quiet_logs import quiet_lifecycle_logs
from flows.run.session import RunIntent, RunSession, run_session, tag_this_flow_run
from flows.observe.summary import metrics_window
from flows.run.runtime import recreate_policy
from nrl_tasks.run_layout import validate_run_id
from nrl_tasks.stages.context import RunContext
from nrl_tasks.stages.resume_plan import RunFacts

__all__ = ["dpo", "dpo_metrics_line", "restore_dpo_run"]

#: ``train`` figures in the metrics line
TRAIN_KEYS = ("loss", "accuracy", "rewards_margin_mean", "rewards_chosen_mean", "rewards_rejected_mean",
              "preference_loss", "sft_loss", "grad_norm", "train_seconds")


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    return f"dpo-{(flow_run.parameters or {}).get('run_id') or 'new'}"


def dpo_metrics_line(step: int, refs: dict[str, Any], checkpoint: Any, wall_s: float) -> dict[str, Any]:
    """The ``metrics.jsonl`` line of DPO step ``step`` from its stage references."""
    train = refs["train"]
    row: dict[str, Any] = {"step": step, "weights_version": step, **{k: train.get(k) for k in TRAIN_KEYS}}
    row["pairs_s"], row["reference_s"], row["train_s"] = (refs[d].seconds for d in ("pairs", "reference", "train"))
    row["train_attempts"] = train.attempts
    if checkpoint is not None and not checkpoint.skipped:
        row["checkpoint_s"] = checkpoint.seconds
    row["step_s"] = wall_s
    return row


def restore_dpo_run(run: RunContext, facts: RunFacts | None, log: Any) -> dict[str, Any]:
    """Bring the fresh policy to the run's trained prefix (see the module docstring), from the
    run's facts as the resume entry read them (:mod:`flows.run.start`; ``None``: a new run):
    ``{"last": T, "restored_from": checkpoint URI or "initial", "replayed": [steps]}``."""
    from nrl_tasks.stages.checkpoint import restore_checkpoint
    from nrl_tasks.stages.dpo import replay_dpo_train

    layout, opts = run.layout, run.storage_options
    # dpo.max_num_steps is in the config hash, so the trained prefix never lies beyond it
    anchor, last = (facts.anchor, facts.last_trained) if facts is not None else (0, 0)
    if anchor:
        restore_checkpoint(run.policy, layout.checkpoint_uri(anchor), opts, verify=False)
    replayed = list(range(anchor + 1, last + 1))
    for step in replayed:
        _make_inputs(run, step)
        replay_dpo_train(run, step)
    restored = layout.checkpoint_uri(anchor) if anchor else "initial"
    if last:
        log.info("resumed at trained step %d: restored %s, replayed %s", last, restored, replayed or "nothing")
    return {"last": last, "restored_from": restored, "replayed": replayed}


def _make_inputs(run: RunContext, step: int) -> None:
    """Make trained step ``step``'s ``pairs`` and ``reference`` again when they are not committed
    (deleted as damaged by the resume entry): its stages, which skip what is committed."""
    import storage

    from nrl_tasks.stages.dpo import preference_pairs, reference_logprobs

    if all(storage.is_committed(run.layout.stage_uri(step, d), **run.storage_kw) for d in ("pairs", "reference")):
        return
    c = quote(run.step(step))
    reference_logprobs(c, preference_pairs(c))


def _run_steps(run: RunContext, session: RunSession, log: Any) -> dict[str, Any]:
    from nrl_tasks.stages.checkpoint import checkpoint
    from nrl_tasks.stages.dpo import dpo_train, preference_pairs, reference_logprobs

    cfg, layout, opts = run.cfg, run.layout, run.storage_options
    total, period = cfg.dpo.max_num_steps, cfg.checkpointing.save_period
    restored = restore_dpo_run(run, session.start.facts, log)
    last = restored["last"]
    publisher, artifacts = BackgroundPublisher(), RunArtifacts(run.run_id, algorithm="DPO")  # updated in place
    have_lines = {int(r["step"]) for r in read_metrics(layout.metrics_uri, opts)}
    try:
        for step in range(max(1, last), total + 1):
            session.fence()
            t0, c = time.perf_counter(), quote(run.step(step))
            pairs = preference_pairs(c)
            reference = reference_logprobs(c, pairs)
            trained = dpo_train(c, pairs, reference)
            due = cfg.checkpointing.enabled and (step % period == 0 or step == total)
            ck = checkpoint(c, trained, session.config_hash) if due else None
            if step > last or step not in have_lines:  # the last trained step's line may be missing
                row = dpo_metrics_line(step, {"pairs": pairs, "reference": reference, "train": trained}, ck,
                                       time.perf_counter() - t0)
                if session.start.optimizer_reset is not None and step == last + 1:  # the first step trained fresh
                    row["optimizer_reset"] = True
                rows = upsert_metrics(layout.metrics_uri, row, opts)
                line = (f"[{run.run_id}] dpo step {step}/{total} loss {row['loss']:.4f} accuracy {row['accuracy']:.3f} "
                        f"margin {row['rewards_margin_mean']:.4f} | step {row['step_s']:.2f}s")
                log.info(line)
                if cfg.logger.console:
                    print(line, flush=True)
                if cfg.logger.artifacts:
                    if due or step == total:  # bounded: the newest lines, at checkpoints and the end
                        publisher.submit(artifacts.metrics.publish, metrics_table(metrics_window(rows)))
                    publisher.submit(artifacts.progress.update, step, total)
    finally:
        publisher.close()
    return {"first_step": last + 1, "restored": {k: v for k, v in restored.items() if k != "last"}}


@flow(name="dpo", flow_run_name=_flow_run_name, validate_parameters=False, persist_result=False)
def dpo(
    config: str | dict | MasterConfig | None = None,
    run_id: str | None = None,
    resume: bool = False,
    overrides: list[str] | None = None,
    storage: str | None = None,
    take_over: bool = False,
    fresh_optimizer: bool = False,
) -> dict[str, Any]:
    """Train with DPO (see the module docstring); returns ``{"run_id", "run_uri", "metrics_uri",
    "last_step", "checkpoints", "final_metrics", "first_step", "restored"}`` (``restored``: where the
    weights came from and the steps replayed).

    ``fresh_optimizer``: with ``resume``, restore a checkpoint saved without optimizer state
    (``checkpointing.save_optimizer: false``; refused otherwise) and train on with a fresh
    optimizer, recorded as ``optimizer_reset`` in ``status.json`` and the metrics line."""
    from nrl_tasks.stages.checkpoint import list_checkpoints
    from nrl_tasks.stages.preferences import snapshot_preferences
    from storage import delete_batch  # (``storage`` is this flow's parameter)

    log = get_run_logger()
    given = run_id
    run_id = validate_run_id(run_id) if run_id else new_run_id("dpo")
    tag_this_flow_run(run_id)  # before the config is read: a flow run refused for its config is tagged too
    cfg = resolve_config(config, overrides, storage, run_id=given if resume else None, algorithm="dpo")
    if cfg.dpo is None:
        raise ValueError("the config has no `dpo` section: it is a GRPO config (nrl grpo), or add `dpo:` for a DPO run")
    intent = RunIntent(resume=resume, take_over=take_over, fresh_optimizer=fresh_optimizer)
    with run_session(cfg, run_id, algorithm="dpo", intent=intent, log=log) as session:
        layout, opts = session.layout, session.storage_options
        for uri in session.start.rebuild:  # damaged, made again below and by the steps (the same bytes)
            delete_batch(uri, **({"storage_options": opts} if opts else {}))
            log.warning("deleted damaged %s: it is made again", uri)
        pairs = snapshot_preferences(layout, cfg, opts)  # a bad preference file fails here, before Ray
        with session.running(max_steps=cfg.dpo.max_num_steps):
            log.info("dpo run %s at %s (config hash %s, %d pairs, resume=%s)", run_id, layout.run_uri,
                     session.config_hash, len(pairs), resume)
            rt = session.start_runtime(with_actors=False)
            if rt.start_policy():  # the weights come from the checkpoint and the replay, never from a live actor
                recreate_policy(rt, "a DPO run restores its policy from its checkpoint and persisted batches", log)
            with quiet_lifecycle_logs(cfg.logger.log_level):
                info = _run_steps(session.context(records={"preferences": pairs}), session, log)
            session.finish(restored=info["restored"])
    rows = read_metrics(layout.metrics_uri, opts)
    return {"run_id": run_id, "run_uri": layout.run_uri, "metrics_uri": layout.metrics_uri, "last_step": cfg.dpo.max_num_steps,
            "checkpoints": [u for _, u in list_checkpoints(layout.checkpoints_uri, opts)],
            "final_metrics": rows[-1] if rows else None, **info}
