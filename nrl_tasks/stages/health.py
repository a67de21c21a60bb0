"""Probing a run's actors: does every worker answer, and which weights does it hold?

Each probe is one trivial call per worker, answered within :func:`probe_timeout_s` (dead,
unreachable and stuck workers alike count as not answering; their calls are cancelled). The flow
probes only when it plans a recovery (at the start of a run and after an actor fault), never on
the happy path of a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nrl_tasks.settings import NrlSettings, nrl_settings
from nrl_tasks.stages.resume_plan import ActorHealth

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.models.generation.interfaces import GenerationInterface
    from nrl_tasks.models.policy.interfaces import PolicyInterface

__all__ = ["PROBE_TIMEOUT_S", "generation_responsive", "policy_responsive", "probe_actors", "probe_timeout_s"]

#: How long a live worker may take to answer a trivial call before it counts as stuck (s);
#: ``NRL_PROBE_TIMEOUT_S`` overrides it (:class:`nrl_tasks.settings.NrlSettings`).
PROBE_TIMEOUT_S: float = NrlSettings.model_fields["probe_timeout_s"].default


def probe_timeout_s() -> float:
    return nrl_settings().probe_timeout_s


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


def policy_responsive(policy: PolicyInterface, timeout_s: float | None = None) -> int | None:
    """The live policy's weights version (every rank answers and agrees), else ``None``."""
    if policy is None:
        return None
    try:
        group = policy.worker_group
    except RuntimeError:
        return None
    versions = _probe(group.run_all_workers_single_data("get_weights_version"), timeout_s or probe_timeout_s())
    if not versions or len(set(versions)) != 1:
        return None
    policy._weights_version = int(versions[0])  # the driver handle's cache, refreshed
    return int(versions[0])


def generation_responsive(generation: GenerationInterface, timeout_s: float | None = None) -> list[dict[str, Any]] | None:
    """Every generation worker's ``{"weights_version", "stale", "rank"}``; ``None`` if one is dead or stuck."""
    if generation is None:
        return None
    if generation.shares_policy_weights:  # colocated: its liveness is the policy's
        return generation.weights_state()
    try:
        refs = generation.worker_group.run_all_workers_single_data("get_weights_state")
    except Exception:  # noqa: BLE001 - shut down
        return None
    return _probe(refs, timeout_s or probe_timeout_s())


def probe_actors(
    actors: Any, *, target: int, policy_fresh: bool = False, checksum_algorithm: str | None = None,
    with_generation: bool = True,
) -> ActorHealth:
    """The :class:`ActorHealth` of a run's actors (``actors``: its ``RunActors``); the policy's
    weights checksum is read only when it holds ``target``, with ``checksum_algorithm`` (that of
    the checksum recorded for ``target``, which it is compared with; default: today's).
    ``with_generation=False``: the run has no generation workers (DPO, SFT): reported alive at
    ``target``, nothing to re-create or refit."""
    pv = policy_responsive(actors.policy)
    if not with_generation:
        checksum = actors.policy.weights_checksum(algorithm=checksum_algorithm) if pv is not None and pv == target > 0 else None
        return ActorHealth(policy_version=pv, generation_version=target, generation_alive=True, policy_checksum=checksum,
                           policy_fresh=policy_fresh)
    states = generation_responsive(actors.generation)
    gv = None
    if states:
        versions = {None if st.get("stale") else st.get("weights_version") for st in states}
        gv = versions.pop() if len(versions) == 1 else None
    checksum = (actors.policy.weights_checksum(algorithm=checksum_algorithm)
                if pv is not None and pv == target and target > 0 else None)
    return ActorHealth(
        policy_version=pv, generation_version=gv, generation_alive=states is not None,
        policy_checksum=checksum, policy_fresh=policy_fresh,
    )
