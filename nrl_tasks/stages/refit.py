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

The attempt runs under a hard deadline (``grpo.refit.timeout_s``): the broadcast group's own
timeout makes a blocked collective raise inside the actors, and a watchdog thread bounds the
driver (Prefect's timeouts cannot interrupt a blocking call). The Prefect task retries with
backoff (``grpo.refit.retries``, ``grpo.refit.retry_delay_s``).

A failed attempt is aborted cleanly (:func:`abort_refit`): every generation worker that still
answers is (still) marked stale, read from its control thread even while its main thread is
blocked, and the producer's broadcast group is closed. Before a retry, a generation worker that
is dead or stuck is re-created (the whole group: fresh workers hold the initial weights, and the
refit below replaces them) and a dead or stuck producer is re-created and restored to the
version (last checkpoint + replay of the persisted train stages); the new attempt then builds a
new communicator on a fresh port. The result lists the failed attempts (``failed_attempts``:
error and the workers' state after the abort).

Test hook: ``NRL_FAULT_REFIT_PARTIAL=STEP[,STEP...]`` makes the first attempt of the refit at
``STEP`` (in this process) fail mid-stream: the driver itself produces the first packed chunk of
a stream (zeros) and then drops the group, so the workers receive part of the bytes and fail.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from prefect import get_run_logger

from nrl_tasks.stages.common import TASK_DEFAULTS, stage_task
from nrl_tasks.stages.faults import arm_actor_kill, fault_point

__all__ = ["RefitFailedError", "abort_refit", "refit", "refit_weights"]

PARTIAL_ENV = "NRL_FAULT_REFIT_PARTIAL"
_INJECTED: set[int] = set()


class RefitFailedError(RuntimeError):
    """A refit attempt failed or missed its deadline; the generation workers are stale."""


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
    from nrl_tasks.utils.collective import get_node_ip

    try:
        return get_node_ip()
    except Exception:  # noqa: BLE001 - no routable address: single machine
        return "127.0.0.1"


def _inject_partial_stream(generation: Any, info: dict[str, Any], version: int, deadline: float) -> None:
    """Driver-side rogue producer: send the first chunk of a stream, then drop the group."""
    import torch

    from nrl_tasks.utils.collective import create_broadcast_group, find_free_port
    from nrl_tasks.utils.packed_tensor import packed_broadcast_producer
    from nrl_tasks.utils.refit import RefitInfo, refit_fingerprint

    parsed = RefitInfo.from_dict(info)
    sizes = [max(1, int(torch.Size(s).numel()) * d.itemsize) for _, s, d in parsed.metadata]
    small = max(max(sizes[: max(1, len(sizes) // 2)]), sum(sizes) // 4, 1)  # several chunks
    fake = dict(info, buffer_size_bytes=small, fingerprint=refit_fingerprint(parsed.metadata, small))
    generation.prepare_refit_info(fake)
    world = 1 + generation_world_size(generation)
    ip, port = "127.0.0.1", find_free_port()
    refs = generation.init_collective(ip, port, world, rank_offset=1)
    group = create_broadcast_group(ip, port, 0, world, timeout_s=max(1.0, deadline - time.monotonic()))
    _ray_get(refs, deadline, "init_collective (injected)")
    upd = generation.update_weights_from_collective(version)
    budget = [small]  # send roughly one chunk, then fail

    def items():
        sent = 0
        for name, shape, dtype in parsed.metadata:
            t = torch.zeros(shape, dtype=dtype)
            if sent > budget[0]:
                raise RefitFailedError("injected refit failure mid-stream (NRL_FAULT_REFIT_PARTIAL)")
            sent += t.numel() * t.element_size()
            yield name, t

    try:
        packed_broadcast_producer(items(), group, 0, None, buffer_size_bytes=small)
    except RefitFailedError:
        pass
    finally:
        group.close()
    import ray

    try:  # the consumers fail (peer gone) and stay stale
        ray.get(list(upd), timeout=max(1.0, deadline - time.monotonic()))
    except Exception:  # noqa: BLE001 - expected
        pass
    raise RefitFailedError("injected refit failure mid-stream (NRL_FAULT_REFIT_PARTIAL)")


def generation_world_size(generation: Any) -> int:
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


def _policy_world_size(policy: Any) -> int:
    for attr in ("world_size", "data_parallel_size"):
        v = getattr(policy, attr, None)
        if callable(v):
            v = v()
        if isinstance(v, int):
            return v
    return 1


def refit_weights(
    policy: Any,
    generation: Any,
    weights_version: int,
    *,
    timeout_s: float,
    verify_checksum: bool = False,
    step: int | None = None,
) -> dict[str, Any]:
    """One refit attempt (see the module docstring). Returns ``{"seconds", "weights_version", ...}``.

    Raises :class:`RefitFailedError` on a missed deadline or a failed stream (workers stale),
    ``RefitMismatchError`` when the two sides disagree on what is sent.
    """
    t0 = time.monotonic()
    deadline = t0 + float(timeout_s)
    s = step if step is not None else weights_version
    generation.mark_stale()
    info = policy.prepare_refit_info()
    if step is not None and str(step) in {s.strip() for s in os.environ.get(PARTIAL_ENV, "").split(",")}:
        if step not in _INJECTED:
            _INJECTED.add(step)
            _inject_partial_stream(generation, info, weights_version, deadline)
    generation.prepare_refit_info(info)
    gen_world = generation_world_size(generation)
    world = 1 + gen_world
    from nrl_tasks.utils.collective import find_free_port

    ip = _node_ip()
    port = find_free_port()
    refs = list(policy.init_collective(ip, port, world, train_world_size=_policy_world_size(policy)))
    refs += list(generation.init_collective(ip, port, world, rank_offset=1, timeout_s=max(1.0, deadline - time.monotonic())))
    _ray_get(refs, deadline, "init_collective")
    t1 = time.monotonic()
    arm_actor_kill("policy", "refit", s, policy.worker_group.workers)
    arm_actor_kill("generation", "refit", s, generation.workers)
    refs = list(policy.broadcast_weights_for_collective()) + list(
        generation.update_weights_from_collective(weights_version)
    )
    fault_point("refit", s, "during")  # the flow process dies while the actors stream
    _ray_get(refs, deadline, "packed broadcast")
    t2 = time.monotonic()
    got = generation.weights_version
    if got != weights_version:
        raise RefitFailedError(f"after refit the generation workers report version {got}, expected {weights_version}")
    out: dict[str, Any] = {
        "weights_version": int(weights_version),
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

    from nrl_tasks.distributed.worker_groups import CONTROL_GROUP

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


#: Failed attempts of the refit in progress, per ``(run_id, weights_version)`` (this process).
_FAILURES: dict[tuple[str, int], list[dict[str, Any]]] = {}


def _retry_condition(task: Any, task_run: Any, state: Any) -> bool:
    """Retry everything but a metadata mismatch (deterministic: a retry cannot fix it)."""
    from nrl_tasks.utils.refit import RefitMismatchError

    try:
        state.result()
    except RefitMismatchError:
        return False
    except Exception:  # noqa: BLE001
        return True
    return True


@stage_task(
    name="refit",
    task_run_name="refit-{run_id}-v{weights_version}",
    retries=3,
    retry_delay_seconds=[1, 2, 4],
    retry_condition_fn=_retry_condition,
    **TASK_DEFAULTS,
)
def refit(cfg: Any, run_id: str, weights_version: int, force: bool = False, step: int | None = None) -> dict[str, Any]:
    """Bring the generation workers to ``weights_version`` (skipped when they already hold it,
    unless ``force``). Retries with backoff; each attempt has a hard deadline; a retry first
    re-creates dead or stuck workers on either side (see the module docstring)."""
    from flows.runtime import get_runtime
    from nrl_tasks.stages.recovery import attempt_number, ensure_generation_alive, ensure_policy, stage_attempts

    rt = get_runtime(cfg, run_id)
    log = get_run_logger()
    attempt = attempt_number()
    if attempt > 1:
        ensure_generation_alive(rt, log)
    if not force and rt.generation.weights_version == weights_version:
        return {
            "stage": "refit", "weights_version": weights_version, "seconds": 0.0, "skipped": True,
            "attempts": stage_attempts(skipped=True),
        }
    ensure_policy(rt, cfg, weights_version, log)  # a dead producer is re-created and restored
    s = step if step is not None else weights_version
    fault_point("refit", s, "before")
    rcfg = cfg.grpo.refit
    key = (run_id, int(weights_version))
    try:
        out = _with_watchdog(
            refit_weights, rcfg.timeout_s + 5.0, rt.policy, rt.generation, weights_version,
            timeout_s=rcfg.timeout_s, verify_checksum=rcfg.verify_checksum, step=s,
        )
    except Exception as exc:
        failure = abort_refit(rt, exc, attempt)
        _FAILURES.setdefault(key, []).append(failure)
        log.warning(
            "refit to version %d failed (%s: %s); aborted, generation workers: %s",
            weights_version, type(exc).__name__, exc, failure["generation"],
        )
        raise
    fault_point("refit", s, "after")
    return {"stage": "refit", "step": s, **out, "attempts": attempt, "failed_attempts": _FAILURES.pop(key, [])}
