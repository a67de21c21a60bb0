"""Recovery of a run's actors inside stage retries: dead or stuck workers are re-created and
brought back to the run's state from what is persisted.

Every stage that calls actors (``generate``, ``logprob``, ``train``, ``checkpoint``, ``validate``,
``refit``) is a Prefect task retried on *actor faults* (:func:`is_actor_fault`: a dead or
unreachable actor, a missed deadline, stale weights): the flow applies the run's
``grpo.stage_retries`` / ``grpo.stage_retry_delay_s`` (``grpo.refit.*`` for ``refit``) with
:func:`with_stage_retries`; the decorators carry the same defaults (:data:`STAGE_RETRY`) for direct
calls. Before its work each such stage calls:

- :func:`ensure_policy` ``(version)``: the policy must answer (every rank, within
  :data:`PROBE_TIMEOUT_S`) and hold exactly the run's weights after ``train`` of step
  ``version`` (version number, and on a retry the weights checksum recorded by that ``train``).
  Otherwise the worker group is killed and re-created if a rank is dead or stuck, then
  :func:`restore_policy`: the newest checkpoint at or before ``version`` is loaded (weights,
  optimizer, scheduler, RNG) or, without one, fresh initial actors are used, and the ``train``
  stages of the steps after it are **replayed from their persisted batches** (no
  regeneration), each verified against its recorded weights checksum.
- :func:`ensure_generation` ``(version)``: the generation workers must answer; dead or stuck
  ones are re-created (the whole group), then a full refit brings them to ``version`` unless
  they hold it.

A replayed step whose train inputs are missing (deleted by ``nrl resume --recompute``) gets them
recomputed first by the ordinary stages (same seeds, generation refitted to the step's weights);
the replay's weights checksum must then equal the one recorded when the step was first trained,
so a trained step's inputs can be repaired but never changed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

__all__ = [
    "PROBE_TIMEOUT_S",
    "DEFAULT_STAGE_RETRIES",
    "DEFAULT_STAGE_RETRY_DELAY_S",
    "STAGE_RETRY",
    "DamagedRunError",
    "attempt_number",
    "ensure_generation",
    "ensure_policy",
    "generation_responsive",
    "is_actor_fault",
    "missing_datasets",
    "policy_responsive",
    "recorded_checksum",
    "recreate_generation",
    "recreate_policy",
    "restore_policy",
    "retry_on_actor_fault",
    "stage_attempts",
    "stage_retry_options",
    "with_stage_retries",
]

_log = logging.getLogger(__name__)

#: How long a live worker may take to answer a trivial call before it counts as stuck (s);
#: ``NRL_PROBE_TIMEOUT_S`` overrides it.
PROBE_TIMEOUT_S = 30.0


def probe_timeout_s() -> float:
    return float(os.environ.get("NRL_PROBE_TIMEOUT_S", PROBE_TIMEOUT_S))

#: The train inputs a replay reads, and what they are computed from (pipeline order).
REPLAY_INPUTS = ("rollouts", "logprobs", "advantages")
STEP_DATASETS = ("prompts", "rollouts", "rewards", "logprobs", "advantages")

_STATE = threading.local()


class DamagedRunError(ValueError):
    """Persisted data a resume or replay needs is damaged, missing or cannot be verified."""


# ---------------------------------------------------------------------------------- retries
def _fault_types() -> tuple[type, ...]:
    import ray.exceptions as rx

    from nrl_tasks.models.generation.interfaces import StaleWeightsError

    types: list[type] = [rx.RayActorError, rx.GetTimeoutError, rx.WorkerCrashedError, rx.ObjectLostError]
    for name in ("ActorUnavailableError", "OwnerDiedError", "NodeDiedError", "RaySystemError"):
        t = getattr(rx, name, None)
        if isinstance(t, type):
            types.append(t)
    types.append(StaleWeightsError)
    from nrl_tasks.utils.collective import CollectiveError

    types.append(CollectiveError)  # a collective whose peer died or timed out
    from nrl_tasks.stages.refit import RefitFailedError

    types.append(RefitFailedError)
    return tuple(types)


def is_actor_fault(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it wraps) means a dead, stuck or stale actor: worth a retry
    after recovery. Bad data, bad config and storage damage are not."""
    types = _fault_types()
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DamagedRunError):
            return False
        if isinstance(exc, types):
            return True
        cause = getattr(exc, "cause", None)  # RayTaskError wraps the worker's exception
        exc = cause if isinstance(cause, BaseException) else (exc.__cause__ or exc.__context__)
    return False


def retry_on_actor_fault(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry actor faults only."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - inspected, not swallowed
        return is_actor_fault(exc)
    return False


#: Decorator defaults of the stages that call actors, for direct task calls; the flow applies the
#: run's ``grpo.stage_retries`` / ``grpo.stage_retry_delay_s`` (:func:`with_stage_retries`).
DEFAULT_STAGE_RETRIES = 2
DEFAULT_STAGE_RETRY_DELAY_S: tuple[float, ...] = (1.0, 3.0)

#: Options merged into the decorators of the stages that call actors (the defaults above).
STAGE_RETRY: dict[str, Any] = {
    "retries": DEFAULT_STAGE_RETRIES,
    "retry_delay_seconds": list(DEFAULT_STAGE_RETRY_DELAY_S),
    "retry_condition_fn": retry_on_actor_fault,
}


def stage_retry_options(cfg: Any) -> dict[str, Any]:
    """Prefect task options of an actor-calling stage for run config ``cfg``: ``retries`` =
    ``grpo.stage_retries``, ``retry_delay_seconds`` = ``grpo.stage_retry_delay_s`` (s; the last
    delay repeats), retried on actor faults only."""
    grpo = getattr(cfg, "grpo", None)
    retries = getattr(grpo, "stage_retries", DEFAULT_STAGE_RETRIES)
    delays = getattr(grpo, "stage_retry_delay_s", DEFAULT_STAGE_RETRY_DELAY_S)
    return {
        "retries": int(retries),
        "retry_delay_seconds": [float(d) for d in delays],
        "retry_condition_fn": retry_on_actor_fault,
    }


def with_stage_retries(task: Any, cfg: Any) -> Any:
    """``task`` with the run's stage-retry options (:func:`stage_retry_options`)."""
    return task.with_options(**stage_retry_options(cfg))


def attempt_number() -> int:
    """1 on a task's first run, 2 on its first retry, ... (1 outside Prefect)."""
    try:
        from prefect.runtime import task_run

        return int(task_run.run_count or 1)
    except Exception:  # noqa: BLE001
        return 1


def stage_attempts(skipped: bool = False) -> int:
    """What a stage reports as its ``attempts`` (the metrics line's ``<stage>_attempts``): the
    Prefect run count of the attempt that returns (1: no retry), or 0 when the first attempt
    found the output already committed (computed by an earlier flow run)."""
    n = attempt_number()
    return 0 if skipped and n == 1 else n


def _logger(logger: Any = None) -> Any:
    if logger is not None:
        return logger
    try:
        from prefect import get_run_logger

        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a flow/task run
        return _log


def _probe(refs: list[Any], timeout_s: float) -> list[Any] | None:
    import ray

    try:
        return ray.get(list(refs), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - dead, unreachable or stuck
        for r in refs:
            try:
                ray.cancel(r)
            except Exception:  # noqa: BLE001
                pass
        return None


# ---------------------------------------------------------------------------------- policy
def policy_responsive(rt: Any, timeout_s: float | None = None) -> int | None:
    """The live policy's weights version (every rank answers and agrees), else ``None``."""
    pol = rt.policy
    if pol is None:
        return None
    try:
        group = pol.worker_group
    except RuntimeError:
        return None
    versions = _probe(group.run_all_workers_single_data("get_weights_version"), timeout_s or probe_timeout_s())
    if not versions or len(set(versions)) != 1:
        return None
    pol._weights_version = int(versions[0])  # the driver handle's cache, refreshed
    return int(versions[0])


def recreate_policy(rt: Any, reason: str, logger: Any = None) -> None:
    """Kill the policy worker group (whatever state its ranks are in) and start fresh actors."""
    log = _logger(logger)
    log.warning("re-creating the policy workers: %s", reason)
    t = time.perf_counter()
    old = rt.policy
    if old is not None:
        try:
            old.worker_group.shutdown(force=True)
        except Exception as exc:  # noqa: BLE001 - already gone
            log.debug("policy shutdown: %s", exc)
    rt.policy = None
    try:  # ranks the handle does not know about (another world size): kill by name
        from nrl_tasks.distributed.worker_groups import RayWorkerGroup

        RayWorkerGroup.attach("lm_policy", rt.namespace).shutdown(force=True)
    except Exception:  # noqa: BLE001 - none left
        pass
    rt.start_policy(fresh=True)
    log.warning("policy workers re-created in %.1fs", time.perf_counter() - t)


def recorded_checksum(rt: Any, step: int) -> str | None:
    """The policy weights checksum recorded by the committed ``train`` of ``step`` (or None)."""
    if step <= 0:
        return None
    from nrl_tasks.stages.common import committed

    return (committed(rt.layout.stage_uri(step, "train"), rt.storage_options) or {}).get("weights_checksum")


def missing_datasets(rt: Any, step: int) -> list[str]:
    """The datasets of ``step`` (prompts .. advantages) that are not committed."""
    import storage

    return [s for s in STEP_DATASETS if not storage.is_committed(rt.layout.stage_uri(step, s), **rt.storage_kw)]


def recompute_step_inputs(rt: Any, cfg: Any, step: int, logger: Any = None) -> list[str]:
    """Recompute the missing datasets of trained ``step`` (policy at ``step - 1``); returns them.

    Only with a recorded weights checksum for the step: the replay that follows must reproduce it.
    """
    missing = missing_datasets(rt, step)
    if not missing:
        return []
    if recorded_checksum(rt, step) is None:
        raise DamagedRunError(
            f"run {rt.run_id}: trained step {step} lacks {missing} and its train recorded no weights checksum "
            "(logger.weights_checksum=false), so recomputed inputs could not be verified; restore a checkpoint "
            f"at or after step {step} instead"
        )
    from nrl_tasks.stages.advantages import advantages
    from nrl_tasks.stages.generate import generate, prompts
    from nrl_tasks.stages.logprob import logprob
    from nrl_tasks.stages.score import score

    _logger(logger).warning("recomputing %s of trained step %d before replaying it", missing, step)
    prompts(cfg, rt.run_id, step)
    with_stage_retries(generate, cfg)(cfg, rt.run_id, step, step - 1)
    score(cfg, rt.run_id, step)
    with_stage_retries(logprob, cfg)(cfg, rt.run_id, step, step - 1)
    advantages(cfg, rt.run_id, step)
    return missing


def restore_policy(rt: Any, cfg: Any, version: int, logger: Any = None, *, fresh: bool = False) -> dict[str, Any]:
    """Make the (responsive) policy hold the run's weights after ``train`` of step ``version``.

    ``fresh``: the actors were just created (initial weights, fresh optimizer). Returns
    ``{"restored_from": checkpoint URI | "initial", "replayed": [steps], "recomputed": {step: [datasets]}}``.
    """
    if getattr(_STATE, "restoring", False):
        raise RuntimeError(f"run {rt.run_id}: policy restore re-entered (the replay did not reach version {version - 1})")
    from nrl_tasks.stages.checkpoint import latest_checkpoint, restore_checkpoint
    from nrl_tasks.stages.train import replay_train

    log = _logger(logger)
    layout, opts = rt.layout, rt.storage_options
    _STATE.restoring = True
    try:
        ck = latest_checkpoint(layout.checkpoints_uri, max_step=version, storage_options=opts) if version > 0 else None
        if ck is not None:
            info = restore_checkpoint(rt.policy, ck[1], opts)
            start = int(info["step"])
            log.info("restored checkpoint %s (weights version %d)", ck[1], start)
        else:
            start = 0
            if not fresh:
                recreate_policy(rt, "back to the initial weights (no checkpoint at or before the target)", log)
        replayed: list[int] = []
        recomputed: dict[int, list[str]] = {}
        for s in range(start + 1, version + 1):
            t = time.perf_counter()
            _STATE.restoring = False  # recomputing inputs calls stages that check the policy (at s - 1)
            try:
                redo = recompute_step_inputs(rt, cfg, s, log)
            finally:
                _STATE.restoring = True
            if redo:
                recomputed[s] = redo
            replay_train(rt, cfg, s)
            replayed.append(s)
            log.info("replayed train of step %d from persisted batches (%.2fs)", s, time.perf_counter() - t)
    finally:
        _STATE.restoring = False
    return {"restored_from": ck[1] if ck else "initial", "replayed": replayed, "recomputed": recomputed}


def ensure_policy(rt: Any, cfg: Any, version: int, logger: Any = None, *, verify: bool | None = None) -> dict[str, Any]:
    """Make sure the policy answers and holds the run's weights after step ``version``.

    ``verify``: also compare the weights checksum with the one recorded by ``train`` of
    ``version`` (default: on a task retry). Returns ``{"restored_from": "live"}`` when nothing
    had to be done, else what :func:`restore_policy` did plus ``"recreated"``.
    """
    log = _logger(logger)
    verify = attempt_number() > 1 if verify is None else verify
    live = policy_responsive(rt)
    if live is None:
        recreate_policy(rt, "a rank is dead or does not answer", log)
        return {**restore_policy(rt, cfg, version, log, fresh=True), "recreated": True}
    if live == version:
        want = recorded_checksum(rt, version) if verify else None
        if want is None or rt.policy.weights_checksum() == want:
            return {"restored_from": "live", "replayed": []}
        log.warning("the live policy at version %d does not hold the recorded weights: restoring", version)
    else:
        log.warning("the live policy holds weights version %d, the run needs %d: restoring", live, version)
    return {**restore_policy(rt, cfg, version, log), "recreated": False}


# ---------------------------------------------------------------------------------- generation
def generation_responsive(rt: Any, timeout_s: float | None = None) -> list[dict[str, Any]] | None:
    """Every generation worker's ``{"weights_version", "stale", "rank"}``; ``None`` if one is dead or stuck."""
    gen = rt.generation
    if gen is None:
        return None
    try:
        refs = gen.worker_group.run_all_workers_single_data("get_weights_state")
    except Exception:  # noqa: BLE001 - shut down
        return None
    return _probe(refs, timeout_s or probe_timeout_s())


def recreate_generation(rt: Any, reason: str, logger: Any = None) -> None:
    """Kill the generation worker group and start fresh workers (initial weights, version 0)."""
    log = _logger(logger)
    log.warning("re-creating the generation workers: %s", reason)
    t = time.perf_counter()
    if rt.generation is not None:
        try:
            rt.generation.worker_group.shutdown(force=True)
        except Exception as exc:  # noqa: BLE001
            log.debug("generation shutdown: %s", exc)
    rt.generation = None
    try:
        from nrl_tasks.distributed.worker_groups import RayWorkerGroup

        RayWorkerGroup.attach("generation", rt.namespace).shutdown(force=True)
    except Exception:  # noqa: BLE001
        pass
    rt.start_generation(fresh=True)
    log.warning("generation workers re-created in %.1fs", time.perf_counter() - t)


def ensure_generation_alive(rt: Any, logger: Any = None) -> bool:
    """Re-create the generation workers if one is dead or stuck; True if they were re-created."""
    if generation_responsive(rt) is not None:
        return False
    recreate_generation(rt, "a worker is dead or does not answer", logger)
    return True


def ensure_generation(rt: Any, cfg: Any, version: int, logger: Any = None, *, step: int | None = None) -> dict[str, Any]:
    """Make sure the generation workers answer and hold ``version`` (full refit if they do not)."""
    log = _logger(logger)
    recreated = ensure_generation_alive(rt, log)
    if rt.generation.weights_version == version:
        return {"recreated": recreated, "refit": False}
    log.warning("generation workers do not hold weights version %d: full refit", version)
    from nrl_tasks.stages.refit import refit

    rcfg = cfg.grpo.refit
    out = refit.with_options(retries=rcfg.retries, retry_delay_seconds=rcfg.retry_delay_s)(
        cfg, rt.run_id, version, force=True, step=step
    )
    return {"recreated": recreated, "refit": True, "refit_seconds": out.get("seconds")}
