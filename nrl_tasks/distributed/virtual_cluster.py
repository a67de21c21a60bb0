"""Ray connection and placement groups for persistent worker groups.

``init_ray`` connects to a running Ray cluster (``address`` or ``RAY_ADDRESS``) or starts a
local one. ``RayVirtualCluster`` reserves *bundles* (one per worker: CPUs, plus one GPU per
bundle when ``use_gpus``) as one placement group per node entry. Placement groups are named
and detached, so a second process (e.g. a flow that crashed and came back) can re-attach to
them with :meth:`RayVirtualCluster.attach` or by constructing the cluster again with the same
``name`` and ``namespace`` (get-if-exists semantics).

Resources are checked before anything is reserved and the reservation is awaited with a
timeout: a cluster that lacks what is asked for raises ``ValueError`` (never enough in total)
or ``RuntimeError`` (not free within ``pg_timeout_s``), never waits forever.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

logger = logging.getLogger(__name__)

_VALID_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _ray():
    import ray

    return ray


def init_ray(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    temp_dir: str | None = None,
    namespace: str | None = None,
) -> str:
    """Connect to Ray, or start a local instance; return the GCS address (``host:port``).

    Order: an already initialised Ray in this process is reused (idempotent); else
    ``address`` or the ``RAY_ADDRESS`` environment variable is connected to; else a local
    Ray is started with ``num_cpus`` logical CPUs (no dashboard, ``temp_dir`` as its temp
    root, loopback only: see :func:`local_ray_options` and :func:`loopback_only`).
    ``namespace`` becomes the driver's default namespace (named actors and placement groups
    are looked up there).
    """
    ray = _ray()
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    target = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {"log_to_driver": False}
    if namespace:
        kwargs["namespace"] = namespace
    if target:
        if num_cpus is not None:
            logger.info("init_ray: num_cpus=%s ignored when connecting to %s", num_cpus, target)
        ray.init(address=target, **kwargs)
    else:
        if num_cpus is not None and num_cpus <= 0:
            raise ValueError(f"init_ray: num_cpus must be > 0, got {num_cpus}")
        with loopback_only():
            ray.init(num_cpus=num_cpus, _temp_dir=temp_dir, **local_ray_options(), **kwargs)
    return ray.get_runtime_context().gcs_address


#: Niceness of the local Ray's worker processes (Ray's default is 15: on a busy machine the flow
#: process and the Prefect server would preempt the training actors).
LOCAL_WORKER_NICENESS = 0


def local_ray_options() -> dict[str, Any]:
    """``ray.init`` options of a local (one-machine) Ray: no dashboard, workers at niceness
    :data:`LOCAL_WORKER_NICENESS` (``worker_niceness``). Start it inside :func:`loopback_only`."""
    return {"include_dashboard": False, "_system_config": {"worker_niceness": LOCAL_WORKER_NICENESS}}


#: Ray's switch for multi-node clusters; off, it takes the node to be a one-machine "cluster".
_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextmanager
def loopback_only() -> Iterator[None]:
    """Within it, a local Ray that ``ray.init`` starts listens on loopback only.

    Ray resolves ``127.0.0.1`` given as the node address to the machine's routable address, so
    its servers (GCS, raylets, core workers, the runtime-env agent, the autoscaler's
    unauthenticated Prometheus endpoint on port 44217) listen on every interface or the node
    address. With ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` it uses the loopback address for all of
    them (Ray 2.60; verified by reading the listening sockets). The daemons ``ray.init`` starts
    take the variable from this process's environment, and this process reads it through the
    already imported constants module, so both are switched; both are put back on exit. Left in
    the environment, the switch would reach every later child of this process: a
    ``ray start --address=...`` there refuses to join a cluster ("not supported on Windows and
    OSX"), which is how it once broke a two-node test run after an in-process flow.
    """
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_CLUSTER_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_CLUSTER_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_CLUSTER_SWITCH, None)
        else:
            os.environ[_CLUSTER_SWITCH] = saved_env


def local_head_session_dir() -> str | None:
    """Session directory of the Ray head *this process* started (``ray.init`` without an
    address), e.g. ``/tmp/ray/session_<date>_<pid>``; ``None`` when connected to an existing
    cluster or not initialised. Every daemon of that head (GCS, raylet, agents, workers) has
    its logs open under it, which is how leftovers of a dead head are recognised."""
    ray = _ray()
    if not ray.is_initialized():
        return None
    from ray._private import worker as _worker  # internal; ``_global_node`` is set by ray.init

    node = getattr(_worker, "_global_node", None)
    if node is None or not node.is_head():
        return None
    return str(node.get_session_dir_path())


def _current_namespace() -> str:
    return _ray().get_runtime_context().namespace


def _lookup_placement_group(name: str, namespace: str):
    """Return the named placement group (``namespace``, else the driver's) or ``None``."""
    for ns in dict.fromkeys([namespace, _current_namespace()]):
        pg = _lookup_placement_group_in(name, ns)
        if pg is not None:
            return pg
    return None


def _lookup_placement_group_in(name: str, namespace: str):
    """Return the named placement group in ``namespace`` or ``None`` (removed ones too)."""
    ray = _ray()
    from ray.util.placement_group import PlacementGroup

    try:
        from ray._private.state import state as _state  # internal but stable since Ray 2.0

        info = _state.get_placement_group_by_name(name, namespace)
    except Exception:  # pragma: no cover - fall back to the public, namespace-bound API
        if namespace != _current_namespace():
            return None
        try:
            return ray.util.get_placement_group(name)
        except ValueError:
            return None
    if info is None or info.get("state") == "REMOVED":
        return None
    from ray._raylet import PlacementGroupID

    pg_id = PlacementGroupID(bytes.fromhex(info["placement_group_id"]))
    bundles = [dict(info["bundles"][i]) for i in sorted(info["bundles"])]
    pg = PlacementGroup(pg_id, bundle_cache=bundles)
    pg._nrl_strategy = info.get("strategy")  # remembered for attach()
    return pg


class RayVirtualCluster:
    """A set of placement groups reserving one bundle per worker.

    Args:
        bundle_ct_per_node_list: bundles (workers) per node entry, e.g. ``[2]`` for two
            workers on one node, ``[2, 2]`` for two nodes of two.
        use_gpus: one GPU per bundle (else CPU-only bundles).
        max_colocated_worker_groups: how many worker groups may share a bundle; each
            worker asks for ``1 / max_colocated_worker_groups`` of its bundle by default.
        num_gpus_per_node: GPUs per node (only checked when ``use_gpus``; 0 = not checked).
        name: prefix of the placement-group names (``f"{name}-pg{i}"``). Empty: a unique
            name is generated (then only this handle can find them).
        placement_group_strategy: Ray strategy per node entry; default ``STRICT_PACK`` (all
            bundles of an entry on one node).
        num_cpus_per_bundle: logical CPUs per bundle (fractions allowed).
        pg_timeout_s: how long to wait for the reservation before ``RuntimeError``.
        namespace: Ray namespace of the placement groups (default: the driver's).
        resources_per_bundle: extra custom resources per bundle.
    """

    def __init__(
        self,
        bundle_ct_per_node_list: list[int],
        use_gpus: bool = False,
        max_colocated_worker_groups: int = 1,
        num_gpus_per_node: int = 0,
        name: str = "",
        placement_group_strategy: str | None = None,
        *,
        num_cpus_per_bundle: float = 1.0,
        pg_timeout_s: float = 60.0,
        namespace: str | None = None,
        resources_per_bundle: dict | None = None,
    ) -> None:
        self._validate(
            bundle_ct_per_node_list,
            max_colocated_worker_groups,
            num_gpus_per_node,
            use_gpus,
            placement_group_strategy,
            num_cpus_per_bundle,
            pg_timeout_s,
            resources_per_bundle,
        )
        ray = _ray()
        if not ray.is_initialized():
            init_ray()
        self.bundle_ct_per_node_list = [int(n) for n in bundle_ct_per_node_list]
        self.use_gpus = bool(use_gpus)
        self.max_colocated_worker_groups = int(max_colocated_worker_groups)
        self.num_gpus_per_node = int(num_gpus_per_node)
        self.placement_group_strategy = placement_group_strategy or "STRICT_PACK"
        self.num_cpus_per_bundle = float(num_cpus_per_bundle)
        self.pg_timeout_s = float(pg_timeout_s)
        self.namespace = namespace or _current_namespace()
        self.resources_per_bundle = dict(resources_per_bundle or {})
        self.name = name or f"nrl-cluster-{os.urandom(4).hex()}"
        self._placement_groups: list[Any] | None = None
        self.attached = False
        self._create_placement_groups()

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _validate(
        bundle_ct_per_node_list,
        max_colocated_worker_groups,
        num_gpus_per_node,
        use_gpus,
        strategy,
        num_cpus_per_bundle,
        pg_timeout_s,
        resources_per_bundle,
    ) -> None:
        if not isinstance(bundle_ct_per_node_list, (list, tuple)) or not bundle_ct_per_node_list:
            raise ValueError(
                "bundle_ct_per_node_list must be a non-empty list of bundle counts per node, "
                f"got {bundle_ct_per_node_list!r}"
            )
        for i, n in enumerate(bundle_ct_per_node_list):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"bundle_ct_per_node_list[{i}] must be a positive int, got {n!r}")
        if int(max_colocated_worker_groups) < 1:
            raise ValueError(
                f"max_colocated_worker_groups must be >= 1, got {max_colocated_worker_groups}"
            )
        if use_gpus and num_gpus_per_node:
            for i, n in enumerate(bundle_ct_per_node_list):
                if n > num_gpus_per_node:
                    raise ValueError(
                        f"bundle_ct_per_node_list[{i}]={n} exceeds num_gpus_per_node="
                        f"{num_gpus_per_node} (one GPU per bundle)"
                    )
        if strategy is not None and strategy not in _VALID_STRATEGIES:
            raise ValueError(
                f"placement_group_strategy must be one of {_VALID_STRATEGIES}, got {strategy!r}"
            )
        if not (num_cpus_per_bundle >= 0):
            raise ValueError(f"num_cpus_per_bundle must be >= 0, got {num_cpus_per_bundle}")
        if not use_gpus and num_cpus_per_bundle == 0 and not resources_per_bundle:
            raise ValueError("a CPU-only bundle needs num_cpus_per_bundle > 0")
        if not (pg_timeout_s > 0):
            raise ValueError(f"pg_timeout_s must be > 0, got {pg_timeout_s}")
        for k, v in (resources_per_bundle or {}).items():
            if k in ("CPU", "GPU"):
                raise ValueError(
                    f"resources_per_bundle[{k!r}]: use num_cpus_per_bundle / use_gpus instead"
                )
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"resources_per_bundle[{k!r}] must be a number >= 0, got {v!r}")

    # ------------------------------------------------------------------ creation
    def bundle_spec(self) -> dict[str, float]:
        """Resources of one bundle (``{"CPU": ..., "GPU": 1, **custom}``)."""
        spec: dict[str, float] = {}
        if self.num_cpus_per_bundle > 0:
            spec["CPU"] = self.num_cpus_per_bundle
        if self.use_gpus:
            spec["GPU"] = 1.0
        spec.update({k: float(v) for k, v in self.resources_per_bundle.items()})
        return spec

    def _pg_name(self, index: int) -> str:
        return f"{self.name}-pg{index}"

    def _check_totals(self) -> None:
        ray = _ray()
        total = ray.cluster_resources()
        need: dict[str, float] = {}
        for key, value in self.bundle_spec().items():
            need[key] = value * self.world_size()
        for key, value in need.items():
            have = float(total.get(key, 0.0))
            if have + 1e-9 < value:
                raise ValueError(
                    f"RayVirtualCluster {self.name!r}: needs {value:g} {key} "
                    f"({self.world_size()} bundles x {self.bundle_spec()[key]:g}) but the Ray "
                    f"cluster has {have:g} {key} in total"
                )
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if self.placement_group_strategy in ("STRICT_PACK",):
            for i, ct in enumerate(self.bundle_ct_per_node_list):
                fits = any(
                    all(
                        float(n["Resources"].get(k, 0.0)) + 1e-9 >= v * ct
                        for k, v in self.bundle_spec().items()
                    )
                    for n in nodes
                )
                if not fits:
                    raise ValueError(
                        f"RayVirtualCluster {self.name!r}: node entry {i} needs {ct} bundles of "
                        f"{self.bundle_spec()} on one node (STRICT_PACK) but no node is that large"
                    )
        if self.placement_group_strategy == "STRICT_SPREAD":
            for i, ct in enumerate(self.bundle_ct_per_node_list):
                if ct > len(nodes):
                    raise ValueError(
                        f"RayVirtualCluster {self.name!r}: node entry {i} has {ct} bundles with "
                        f"STRICT_SPREAD but the cluster has {len(nodes)} nodes"
                    )

    def _create_placement_groups(self) -> None:
        from ray.util.placement_group import placement_group, remove_placement_group

        existing = [
            _lookup_placement_group(self._pg_name(i), self.namespace)
            for i in range(len(self.bundle_ct_per_node_list))
        ]
        if all(pg is not None for pg in existing):
            for i, pg in enumerate(existing):
                if pg.bundle_count != self.bundle_ct_per_node_list[i]:
                    raise ValueError(
                        f"placement group {self._pg_name(i)!r} exists with {pg.bundle_count} "
                        f"bundles, asked for {self.bundle_ct_per_node_list[i]}"
                    )
            self._placement_groups = existing
            self.attached = True
            self._wait_ready()
            return
        if any(pg is not None for pg in existing):
            missing = [self._pg_name(i) for i, pg in enumerate(existing) if pg is None]
            raise RuntimeError(
                f"RayVirtualCluster {self.name!r} is partially present in namespace "
                f"{self.namespace!r}: missing {missing}; call shutdown() on it first"
            )
        self._check_totals()
        if self.namespace != _current_namespace():
            # Ray names placement groups in the creating driver's namespace; lookups try both.
            logger.debug(
                "RayVirtualCluster %r: placement groups live in the driver namespace %r, not %r",
                self.name,
                _current_namespace(),
                self.namespace,
            )
        pgs = []
        try:
            for i, ct in enumerate(self.bundle_ct_per_node_list):
                pgs.append(
                    placement_group(
                        [self.bundle_spec() for _ in range(ct)],
                        strategy=self.placement_group_strategy,
                        name=self._pg_name(i),
                        lifetime="detached",
                    )
                )
            self._placement_groups = pgs
            self._wait_ready()
        except BaseException:
            for pg in pgs:
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001 - best effort cleanup
                    pass
            self._placement_groups = None
            raise

    def _wait_ready(self) -> None:
        ray = _ray()
        assert self._placement_groups is not None
        deadline = time.monotonic() + self.pg_timeout_s
        for i, pg in enumerate(self._placement_groups):
            left = max(0.1, deadline - time.monotonic())
            ready, _ = ray.wait([pg.ready()], timeout=left)
            if not ready:
                avail = ray.available_resources()
                raise RuntimeError(
                    f"RayVirtualCluster {self.name!r}: placement group {self._pg_name(i)!r} "
                    f"({self.bundle_ct_per_node_list[i]} x {self.bundle_spec()}, "
                    f"{self.placement_group_strategy}) not ready after {self.pg_timeout_s:g} s; "
                    f"free resources now: "
                    f"CPU={avail.get('CPU', 0):g} GPU={avail.get('GPU', 0):g}"
                )

    # ------------------------------------------------------------------ attach
    @classmethod
    def attach(
        cls,
        name: str,
        namespace: str | None = None,
        *,
        pg_timeout_s: float = 60.0,
    ) -> "RayVirtualCluster":
        """Re-attach to the named placement groups of a cluster created by another process.

        Raises ``LookupError`` naming the placement group when none exists.
        """
        ray = _ray()
        if not ray.is_initialized():
            init_ray(namespace=namespace)
        namespace = namespace or _current_namespace()
        pgs = []
        while True:
            pg = _lookup_placement_group(f"{name}-pg{len(pgs)}", namespace)
            if pg is None:
                break
            pgs.append(pg)
        if not pgs:
            raise LookupError(
                f"no placement group {name + '-pg0'!r} in Ray namespace {namespace!r}"
            )
        self = cls.__new__(cls)
        self.bundle_ct_per_node_list = [pg.bundle_count for pg in pgs]
        spec = dict(pgs[0].bundle_specs[0])
        self.use_gpus = spec.get("GPU", 0) > 0
        self.max_colocated_worker_groups = 1
        self.num_gpus_per_node = 0
        self.placement_group_strategy = getattr(pgs[0], "_nrl_strategy", None) or "STRICT_PACK"
        self.num_cpus_per_bundle = float(spec.get("CPU", 0.0))
        self.pg_timeout_s = float(pg_timeout_s)
        self.namespace = namespace
        self.resources_per_bundle = {
            k: v for k, v in spec.items() if k not in ("CPU", "GPU") and not k.startswith("bundle_group")
        }
        self.name = name
        self._placement_groups = pgs
        self.attached = True
        self._wait_ready()
        return self

    # ------------------------------------------------------------------ queries
    def get_placement_groups(self) -> list[Any]:
        """The placement groups, one per node entry (raises after ``shutdown``)."""
        if self._placement_groups is None:
            raise RuntimeError(f"RayVirtualCluster {self.name!r} has been shut down")
        return list(self._placement_groups)

    def bundle_locations(self) -> list[tuple[int, int]]:
        """``(placement_group_index, bundle_index)`` of every bundle, in worker-rank order."""
        return [
            (pg_idx, b)
            for pg_idx, ct in enumerate(self.bundle_ct_per_node_list)
            for b in range(ct)
        ]

    def world_size(self) -> int:
        """Total number of bundles (= workers a group placed on this cluster has by default)."""
        return int(sum(self.bundle_ct_per_node_list))

    def node_count(self) -> int:
        return len(self.bundle_ct_per_node_list)

    def worker_resources(self) -> dict[str, float]:
        """Default resources of one worker: its bundle divided by the colocation factor."""
        share = 1.0 / self.max_colocated_worker_groups
        return {k: v * share for k, v in self.bundle_spec().items()}

    def shutdown(self) -> bool:
        """Remove the placement groups (actors placed in them are killed by Ray). Idempotent."""
        if self._placement_groups is None:
            return False
        from ray.util.placement_group import remove_placement_group

        for pg in self._placement_groups:
            try:
                remove_placement_group(pg)
            except Exception as exc:  # noqa: BLE001 - already gone
                logger.debug("remove_placement_group: %s", exc)
        self._placement_groups = None
        return True

    def __repr__(self) -> str:
        return (
            f"RayVirtualCluster(name={self.name!r}, namespace={self.namespace!r}, "
            f"bundles={self.bundle_ct_per_node_list}, bundle={self.bundle_spec()})"
        )
