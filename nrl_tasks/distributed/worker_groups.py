"""Named, persistent groups of Ray actors placed on a :class:`RayVirtualCluster`.

Worker ``rank`` is the actor ``f"{name_prefix}-{rank}"`` in Ray namespace ``namespace``
(convention: ``f"nrl-{run_id}"``), created with ``get_if_exists=True`` and, by default,
``lifetime="detached"``: a group created by one process can be re-attached by name from
another (:meth:`RayWorkerGroup.attach`) and outlives its creator until ``shutdown()`` or
until the Ray cluster stops. Actors never restart on their own (``max_restarts=0``): an actor
restarted by Ray would answer calls with none of its state, which is worse than a clear
``RayActorError``.

Each worker sees the environment variables ``NRL_WORKER_RANK``, ``NRL_WORKER_WORLD_SIZE`` and
``NRL_WORKER_GROUP`` (plus ``env_vars``), so an actor class can learn its rank without
per-rank constructor arguments (read back with :class:`nrl_tasks.settings.WorkerEnv`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, Sequence, TypeVar

from nrl_tasks.settings import WorkerEnv

logger = logging.getLogger(__name__)

RANK_ENV = "NRL_WORKER_RANK"
WORLD_SIZE_ENV = "NRL_WORKER_WORLD_SIZE"
GROUP_ENV = "NRL_WORKER_GROUP"


def _ray():
    import ray

    return ray


_ENV_KWARG = "_nrl_worker_env"
#: Concurrency group (one thread) of every actor made from a plain class: methods marked
#: ``@ray.method(concurrency_group=CONTROL_GROUP)`` (or :func:`control_method`; e.g. a status
#: query) answer while the default group is busy with a long call.
CONTROL_GROUP = "control"

_Method = TypeVar("_Method", bound=Callable[..., Any])


def control_method(method: _Method) -> _Method:
    """``@ray.method(concurrency_group=CONTROL_GROUP)`` when Ray is installed; otherwise the
    method unchanged, so an actor class still imports and runs in a process without Ray."""
    try:
        import ray
    except ImportError:
        return method
    return ray.method(concurrency_group=CONTROL_GROUP)(method)


def _with_env(cls: type) -> type:
    """Subclass of ``cls`` whose constructor first applies environment variables."""

    def __init__(self, *args, **kwargs):
        os.environ.update(kwargs.pop(_ENV_KWARG, None) or {})
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__})


def _world_size_of(handle) -> int | None:
    """Ask a live worker for the world size it was created with (None if it cannot say)."""
    ray = _ray()

    def _read(_self):
        return WorkerEnv().world_size or None

    for group in (CONTROL_GROUP, None):
        try:
            call = handle.__ray_call__.options(concurrency_group=group) if group else handle.__ray_call__
            return ray.get(call.remote(_read), timeout=60)
        except Exception:  # noqa: BLE001 - no control group, dead or busy actor: caller decides
            continue
    return None


class RayWorkerGroup:
    """A fixed-size group of named Ray actors, one per cluster bundle.

    Args:
        cluster: the :class:`~nrl_tasks.distributed.virtual_cluster.RayVirtualCluster`
            whose bundles host the workers (worker ``i`` goes to bundle ``i``, or to
            ``bundle_indices[i]`` when given).
        actor_cls: a plain class (wrapped with ``ray.remote``) or a Ray actor class.
        name_prefix: actor names are ``f"{name_prefix}-{rank}"``.
        namespace: Ray namespace of the actors (default: the driver's).
        num_workers: default ``cluster.world_size()`` (or ``len(bundle_indices)``).
        actor_kwargs: constructor kwargs, one dict for all workers or one per worker.
        env_vars: extra environment variables for the worker processes.
        detached: ``lifetime="detached"`` (survive the creating driver).
        num_cpus_per_worker: logical CPUs per actor (default: its bundle's CPU share).
        num_gpus_per_worker: GPUs per actor (default: its bundle's GPU share).
        bundle_indices: explicit ``(placement_group_index, bundle_index)`` per worker.
    """

    def __init__(
        self,
        cluster,
        actor_cls,
        *,
        name_prefix: str,
        namespace: str | None = None,
        num_workers: int | None = None,
        actor_kwargs: dict | Sequence[dict] | None = None,
        env_vars: dict[str, str] | None = None,
        detached: bool = True,
        num_cpus_per_worker: float | None = None,
        num_gpus_per_worker: float | None = None,
        bundle_indices: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        ray = _ray()
        if not name_prefix or not isinstance(name_prefix, str):
            raise ValueError(f"name_prefix must be a non-empty str, got {name_prefix!r}")
        locations = list(bundle_indices) if bundle_indices is not None else cluster.bundle_locations()
        if num_workers is None:
            num_workers = len(locations)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        if num_workers > len(locations):
            raise ValueError(
                f"num_workers={num_workers} exceeds the {len(locations)} bundles available "
                f"on cluster {getattr(cluster, 'name', cluster)!r}"
            )
        locations = locations[:num_workers]
        pgs = cluster.get_placement_groups()
        for pg_idx, b_idx in locations:
            if not (0 <= pg_idx < len(pgs)) or not (0 <= b_idx < cluster.bundle_ct_per_node_list[pg_idx]):
                raise ValueError(f"bundle index ({pg_idx}, {b_idx}) is not on cluster {cluster.name!r}")
        if isinstance(actor_kwargs, (list, tuple)):
            if len(actor_kwargs) != num_workers:
                raise ValueError(
                    f"actor_kwargs has {len(actor_kwargs)} entries for {num_workers} workers"
                )
            per_worker_kwargs = [dict(k) for k in actor_kwargs]
        else:
            per_worker_kwargs = [dict(actor_kwargs or {}) for _ in range(num_workers)]

        share = cluster.worker_resources()
        cpus = share.get("CPU", 0.0) if num_cpus_per_worker is None else float(num_cpus_per_worker)
        gpus = share.get("GPU", 0.0) if num_gpus_per_worker is None else float(num_gpus_per_worker)
        bundle = cluster.bundle_spec()
        if cpus < 0 or cpus > bundle.get("CPU", 0.0) + 1e-9:
            raise ValueError(
                f"num_cpus_per_worker={cpus:g} does not fit a bundle with {bundle.get('CPU', 0.0):g} CPU"
            )
        if gpus < 0 or gpus > bundle.get("GPU", 0.0) + 1e-9:
            raise ValueError(
                f"num_gpus_per_worker={gpus:g} does not fit a bundle with {bundle.get('GPU', 0.0):g} GPU"
            )

        self.cluster = cluster
        self.name_prefix = name_prefix
        self.namespace = namespace or ray.get_runtime_context().namespace
        self.detached = bool(detached)
        is_ray_cls = hasattr(actor_cls, "options") and hasattr(actor_cls, "remote")
        # a plain class gets its environment in the constructor: a per-actor runtime_env would
        # cost seconds per actor (Ray cannot reuse a worker process for it)
        remote_cls = (
            actor_cls if is_ray_cls else ray.remote(concurrency_groups={CONTROL_GROUP: 1})(_with_env(actor_cls))
        )
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.preexisting: list[bool] = []
        workers = []
        for rank, (pg_idx, b_idx) in enumerate(locations):
            name = self.actor_name(rank)
            self.preexisting.append(self._exists(name, self.namespace))
            env = {
                **(env_vars or {}),
                RANK_ENV: str(rank),
                WORLD_SIZE_ENV: str(num_workers),
                GROUP_ENV: name_prefix,
            }
            options: dict[str, Any] = dict(
                name=name,
                namespace=self.namespace,
                get_if_exists=True,
                max_restarts=0,
                max_concurrency=1,
                num_cpus=cpus,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pgs[pg_idx],
                    placement_group_bundle_index=b_idx,
                    placement_group_capture_child_tasks=False,
                ),
            )
            if self.detached:
                options["lifetime"] = "detached"
            kwargs = dict(per_worker_kwargs[rank])
            if is_ray_cls:
                options["runtime_env"] = {"env_vars": env}
            else:
                kwargs[_ENV_KWARG] = env
            workers.append(remote_cls.options(**options).remote(**kwargs))
        self._workers = workers

    # ------------------------------------------------------------------ names
    def actor_name(self, rank: int) -> str:
        return f"{self.name_prefix}-{rank}"

    @staticmethod
    def _exists(name: str, namespace: str) -> bool:
        try:
            _ray().get_actor(name, namespace=namespace)
            return True
        except ValueError:
            return False

    @classmethod
    def attach(cls, name_prefix: str, namespace: str, *, world_size: int | None = None) -> "RayWorkerGroup":
        """Re-attach to a running group by name (e.g. from another process).

        The world size is read from worker 0 (or given). Raises ``LookupError`` naming the
        first missing actor.
        """
        ray = _ray()
        if not ray.is_initialized():
            from .virtual_cluster import init_ray

            init_ray(namespace=namespace)

        def _get(rank: int):
            name = f"{name_prefix}-{rank}"
            try:
                return ray.get_actor(name, namespace=namespace)
            except ValueError:
                raise LookupError(
                    f"no Ray actor {name!r} in namespace {namespace!r} (worker group "
                    f"{name_prefix!r} is not running)"
                ) from None

        first = _get(0)
        if world_size is None:
            world_size = _world_size_of(first)
        if world_size is None:  # an actor not created by RayWorkerGroup: scan names
            handles = [first]
            while cls._exists(f"{name_prefix}-{len(handles)}", namespace):
                handles.append(_get(len(handles)))
        else:
            handles = [first] + [_get(r) for r in range(1, world_size)]
        self = cls.__new__(cls)
        self.cluster = None
        self.name_prefix = name_prefix
        self.namespace = namespace
        self.detached = True
        self.preexisting = [True] * len(handles)
        self._workers = handles
        return self

    # ------------------------------------------------------------------ properties
    @property
    def workers(self) -> list[Any]:
        return list(self._workers)

    @property
    def world_size(self) -> int:
        return len(self._workers)

    # ------------------------------------------------------------------ dispatch
    def run_all_workers_single_data(self, method: str, *args, **kwargs) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every worker; one ObjectRef per worker."""
        return [getattr(w, method).remote(*args, **kwargs) for w in self._workers]

    def run_all_workers_multiple_data(self, method: str, *args_lists, **kwargs_lists) -> list[Any]:
        """Worker ``i`` gets ``args_lists[j][i]`` / ``kwargs_lists[k][i]`` (each of world-size length)."""
        n = self.world_size
        for j, lst in enumerate(args_lists):
            if len(lst) != n:
                raise ValueError(f"positional argument list {j} has {len(lst)} entries for {n} workers")
        for k, lst in kwargs_lists.items():
            if len(lst) != n:
                raise ValueError(f"keyword argument list {k!r} has {len(lst)} entries for {n} workers")
        return [
            getattr(w, method).remote(
                *[lst[i] for lst in args_lists], **{k: lst[i] for k, lst in kwargs_lists.items()}
            )
            for i, w in enumerate(self._workers)
        ]

    def run_all_workers_sharded_data(self, method: str, shards: Sequence[Any], *args, **kwargs) -> list[Any]:
        """Worker ``i`` gets ``method(shards[i], *args, **kwargs)`` (common args put once)."""
        ray = _ray()
        if len(shards) != self.world_size:
            raise ValueError(f"got {len(shards)} shards for {self.world_size} workers")
        args = tuple(ray.put(a) if _is_large(a) else a for a in args)
        kwargs = {k: (ray.put(v) if _is_large(v) else v) for k, v in kwargs.items()}
        return [getattr(w, method).remote(shard, *args, **kwargs) for w, shard in zip(self._workers, shards)]

    def run_single_worker(self, rank: int, method: str, *args, **kwargs):
        """Call ``method`` on worker ``rank`` only; one ObjectRef."""
        return getattr(self._workers[rank], method).remote(*args, **kwargs)

    @staticmethod
    def get_all_worker_results(refs: Sequence[Any], timeout: float | None = None) -> list[Any]:
        return _ray().get(list(refs), timeout=timeout)

    # ------------------------------------------------------------------ lifecycle
    def alive(self, timeout_s: float = 30.0) -> bool:
        """True when every worker answers a no-op call within ``timeout_s`` (in the control
        group, so a worker busy with a long call still counts as alive)."""
        ray = _ray()
        refs = []
        for w in self._workers:
            try:
                refs.append(w.__ray_ready__.options(concurrency_group=CONTROL_GROUP).remote())
            except Exception:  # noqa: BLE001 - an actor class without the control group
                refs.append(w.__ray_ready__.remote())
        try:
            ray.get(refs, timeout=timeout_s)
            return True
        except Exception:  # noqa: BLE001 - dead, busy or missing actor
            return False

    def shutdown(self, force: bool = False, timeout_s: float = 30.0) -> bool:
        """Stop every worker. Graceful: call the actor's ``shutdown()`` (if it has one) then
        kill; ``force``: kill at once. Idempotent; returns True if anything was stopped."""
        ray = _ray()
        if not self._workers:
            return False
        if not force:
            refs = []
            for w in self._workers:
                try:
                    refs.append(w.shutdown.remote())
                except Exception:  # noqa: BLE001 - no such method / actor gone
                    pass
            if refs:
                try:
                    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
                except Exception:  # noqa: BLE001
                    pass
        for w in self._workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - already dead
                logger.debug("ray.kill: %s", exc)
        # wait until the names are released, so a new group can be created at once
        deadline = time.monotonic() + timeout_s
        for rank in range(len(self._workers)):
            while self._exists(self.actor_name(rank), self.namespace) and time.monotonic() < deadline:
                time.sleep(0.05)
        self._workers = []
        return True

    def __len__(self) -> int:
        return self.world_size

    def __repr__(self) -> str:
        return f"RayWorkerGroup({self.name_prefix!r}, namespace={self.namespace!r}, world_size={self.world_size})"


def _is_large(obj: Any) -> bool:
    """Arguments worth one ``ray.put`` instead of one copy per worker."""
    try:
        import torch

        if isinstance(obj, torch.Tensor):
            return obj.numel() * obj.element_size() > 100_000
    except ImportError:  # pragma: no cover
        pass
    if hasattr(obj, "data") and isinstance(getattr(obj, "data", None), dict):
        return True  # a BatchedDataDict (UserDict)
    return False
