"""``refit`` stage: move the policy's weights to the generation workers, as a transaction.

Sequence (one attempt, :func:`refit_weights`):

1. mark every generation worker stale (a failure anywhere below leaves them refusing
   ``generate``, never serving mixed weights);
2. ``info = policy.prepare_refit_info(); generation.prepare_refit_info(info)``: each worker
   checks names/shapes/dtypes/buffer size against its own model (``RefitMismatchError`` names
   the first differing parameter; not retried);
3. a fresh broadcast group on a fresh port (policy rank 0, generation ranks 1..n; each side
   closes any previous group first, so a retry re-creates the communicator);
4. packed broadcast; the workers adopt the version after the last byte;
5. verify every worker reports the version (and, in debug mode, the policy's weights checksum).

Colocated generation (``generation.colocated.enabled``, the ``hf`` backend sampling inside the
policy workers) shares the policy's weights: the attempt only records the version
(``bytes`` 0, ``colocated`` True).

The attempt runs under a hard deadline (``grpo.refit.timeout_s``): the broadcast group's own
timeout makes a blocked collective raise inside the actors, and a watchdog thread bounds the
driver (Prefect's timeouts cannot interrupt a blocking call).

A failed attempt is aborted cleanly (:func:`abort_refit`): every generation worker that still
answers is (still) marked stale, read from its control thread even while its main thread is
blocked, and the producer's broadcast group is closed; the failure is recorded on the run. The
task itself does not retry: a failed refit fails the step, and the flow's recovery
(:mod:`flows.run.recovery`) re-creates a dead or stuck worker on either side (fresh generation
workers hold the initial weights; a fresh producer is restored to the version from the last
checkpoint and the persisted train stages), refits over a new communicator on a fresh port and
runs the step again, under ``grpo.refit.retries`` / ``grpo.refit.retry_delay_s``. The refit that
succeeds lists the failed attempts (``failed_attempts``: error and the workers' state after the
abort).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger, task

from nrl_tasks.distributed.worker_groups import CONTROL_GROUP
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.errors import RefitFailedError, StalePolicyError
from nrl_tasks.stages.refs import ActionResult, DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, stage_failures
from nrl_tasks.utils.collective import find_free_port, get_node_ip
from nrl_tasks.utils.refit import RefitInfo

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.models.generation.interfaces import GenerationInterface
    from nrl_tasks.models.policy.interfaces import PolicyInterface

__all__ = ["RefitFailedError", "abort_refit", "refit", "refit_weights"]

#: ``(role, workers)`` -> None: told right before the broadcast calls into each side
ActorCallHook = Callable[[str, Sequence[Any]], None]


def _ray_get(refs: list[Any], deadline: float, what: str) -> list[Any]:
    import ray

    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise RefitFailedError(f"refit deadline passed before {what}")
    try:
        return ray.get(list(refs), timeout=remaining)
    except ray.exceptions.GetTimeoutError:
        raise RefitFailedError(f"refit: {what} did not finish before the deadline") from None


def _node_ip() -> str:
    try:
        return get_node_ip()
    except Exception:  # noqa: BLE001 - no routable address: single machine
        return "127.0.0.1"


def generation_world_size(generation: GenerationInterface) -> int:
    for attr in ("world_size", "num_workers"):
        v = getattr(generation, attr, None)
        if callable(v):
            v = v()
        if isinstance(v, int):
            return v
    wg = getattr(generation, "worker_group", None)
    if wg is not None:
        return int(wg.world_size)
    raise AttributeError("cannot tell the generation world size")


def _policy_world_size(policy: PolicyInterface) -> int:
    for attr in ("world_size", "data_parallel_size"):
        v = getattr(policy, attr, None)
        if callable(v):
            v = v()
        if isinstance(v, int):
            return v
    return 1


def refit_weights(
    policy: PolicyInterface,
    generation: GenerationInterface,
    weights_version: int,
    *,
    timeout_s: float,
    verify_checksum: bool = False,
    on_actor_call: ActorCallHook | None = None,
    on_streaming: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One refit attempt (see the module docstring). Returns ``{"seconds", "weights_version",
    "bytes", ...}`` (``bytes``: what the broadcast carried).

    ``on_actor_call(role, workers)`` runs right before the broadcast calls into each side,
    ``on_streaming()`` while both sides stream (the stage's observers). Raises
    :class:`RefitFailedError` on a missed deadline or a failed stream (workers stale),
    ``RefitMismatchError`` when the two sides disagree on what is sent.
    """
    t0 = time.monotonic()
    deadline = t0 + float(timeout_s)
    generation.mark_stale()
    if generation.shares_policy_weights:  # colocated: generation runs on the policy's own weights
        out = generation.record_refit(weights_version)
        return {**out, "seconds": time.monotonic() - t0, "setup_seconds": 0.0, "broadcast_seconds": 0.0}
    info = policy.prepare_refit_info()
    generation.prepare_refit_info(info)
    gen_world = generation_world_size(generation)
    world = 1 + gen_world

    ip = _node_ip()
    port = find_free_port()
    refs = list(policy.init_collective(ip, port, world, train_world_size=_policy_world_size(policy)))
    refs += list(generation.init_collective(ip, port, world, rank_offset=1, timeout_s=max(1.0, deadline - time.monotonic())))
    _ray_get(refs, deadline, "init_collective")
    t1 = time.monotonic()
    if on_actor_call is not None:
        on_actor_call("policy", policy.worker_group.workers)
        on_actor_call("generation", generation.workers)
    refs = list(policy.broadcast_weights_for_collective()) + list(
        generation.update_weights_from_collective(weights_version)
    )
    if on_streaming is not None:
        on_streaming()
    _ray_get(refs, deadline, "packed broadcast")
    t2 = time.monotonic()
    got = generation.weights_version
    if got != weights_version:
        raise RefitFailedError(f"after refit the generation workers report version {got}, expected {weights_version}")

    out: dict[str, Any] = {
        "weights_version": int(weights_version),
        "bytes": RefitInfo.from_dict(info).total_bytes,  # the adapters only, for a LoRA policy on hf
        "seconds": t2 - t0,
        "setup_seconds": t1 - t0,
        "broadcast_seconds": t2 - t1,
    }
    if verify_checksum:
        want, have = policy.weights_checksum(), generation.weights_checksum()
        if want != have:
            generation.mark_stale()
            raise RefitFailedError(f"refit checksum mismatch: policy {want}, generation {have}")
        out["checksum"] = have
    return out


def _with_watchdog(fn: Any, deadline_s: float, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` in a daemon thread; ``RefitFailedError`` if it is not done in ``deadline_s``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    th = threading.Thread(target=run, name="nrl-refit", daemon=True)
    th.start()
    th.join(deadline_s)
    if th.is_alive():
        raise RefitFailedError(f"refit did not finish within its {deadline_s:g} s deadline (watchdog)")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _control_call(handle: Any, fn: Any, timeout_s: float) -> Any:
    """Run ``fn(actor)`` in the actor's control thread (answers while its main thread is blocked)."""
    import ray

    return ray.get(handle.__ray_call__.options(concurrency_group=CONTROL_GROUP).remote(fn), timeout=timeout_s)


def _mark_stale_and_read(actor: Any) -> dict[str, Any]:
    actor.mark_stale()
    return actor.get_weights_state()


def abort_refit(rt: Any, error: BaseException, attempt: int, *, timeout_s: float = 2.0) -> dict[str, Any]:
    """Clean up after a failed attempt (bounded, best effort); returns what it found.

    Each generation worker that answers is marked stale (again) and reports its state from its
    control thread; the producer's broadcast group is closed (queued behind a blocked broadcast,
    not waited for). Per worker ``alive``: True (answered), False (dead), None (no answer within
    ``timeout_s``: hung, or still unwinding its broadcast; it stays stale either way, since only a
    complete refit clears the flag).
    """
    import ray

    states = []
    if rt.generation is not None and rt.generation.shares_policy_weights:  # colocated: nothing was streamed
        rt.generation.mark_stale()
        return {"attempt": attempt, "error": f"{type(error).__name__}: {error}"[:500], "generation": rt.generation.weights_state()}
    workers = rt.generation.workers if rt.generation is not None else []
    for rank, w in enumerate(workers):
        try:
            st = _control_call(w, _mark_stale_and_read, timeout_s)
            states.append({**st, "rank": rank, "alive": True})
        except ray.exceptions.GetTimeoutError:
            states.append({"rank": rank, "alive": None, "error": "no answer"})
        except Exception as exc:  # noqa: BLE001 - dead or unreachable
            states.append({"rank": rank, "alive": False, "error": type(exc).__name__})
    try:
        for w in rt.policy.worker_group.workers:
            w.close_refit_group.remote()
    except Exception:  # noqa: BLE001 - producer gone
        pass
    for w, st in zip(workers, states):
        if st.get("alive"):
            try:
                w.teardown_collective.remote()
            except Exception:  # noqa: BLE001
                pass
    return {"attempt": attempt, "error": f"{type(error).__name__}: {error}"[:500], "generation": states}


@task(name="refit", task_run_name="refit-{ctx.run_id}-v{weights_version}", **TASK_DEFAULTS)
def refit(ctx: StepContext, trained: DatasetRef | None, weights_version: int, force: bool = False) -> ActionResult:
    """Bring the generation workers to ``weights_version`` (the policy's weights after ``trained``;
    ``None`` before the first step or in a recovery). Skipped when they already hold it, unless
    ``force``. One attempt under a hard deadline; a failure is aborted cleanly, recorded on the run
    (reported by the refit that succeeds, ``failed_attempts``) and raised for the flow to recover."""
    run = ctx.run
    rcfg = ctx.cfg.grpo.refit
    if not force and run.generation.weights_version == weights_version:
        done = run.attempts.get((ctx.step, "refit"), 0)
        return ActionResult("refit", ctx.step, weights_version, skipped=True, attempts=done)
    with stage_failures(ctx, "refit") as attempt:
        have = run.policy.weights_version
        if have != weights_version:
            raise StalePolicyError(f"refit to version {weights_version}: the policy holds {have}")
        try:
            ctx.emit("refit", "start")
            out = _with_watchdog(
                refit_weights, rcfg.timeout_s + 5.0, run.policy, run.generation, weights_version,
                timeout_s=rcfg.timeout_s, verify_checksum=rcfg.verify_checksum,
                on_actor_call=lambda role, workers: ctx.actor_call("refit", role, workers),
                on_streaming=lambda: ctx.emit("refit", "computed"),
            )
        except Exception as exc:
            failure = abort_refit(run, exc, attempt)
            run.refit_failures.setdefault(int(weights_version), []).append(failure)
            get_run_logger().warning(
                "refit to version %d failed (%s: %s); aborted, generation workers: %s",
                weights_version, type(exc).__name__, exc, failure["generation"],
            )
            raise
        ctx.emit("refit", "committed")
    info = {**out, "failed_attempts": run.refit_failures.pop(int(weights_version), [])}
    return ActionResult("refit", ctx.step, weights_version, seconds=out["seconds"], attempts=attempt, info=info)
