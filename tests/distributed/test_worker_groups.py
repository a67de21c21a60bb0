"""RayWorkerGroup: named detached actors, dispatch helpers, attach from another process."""

from __future__ import annotations

import os
import uuid

import pytest

from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
from nrl_tasks.distributed.worker_groups import RayWorkerGroup


class Counter:
    """A small stateful actor: its state must survive re-attachment."""

    def __init__(self, start: int = 0) -> None:
        self.value = start

    def rank(self) -> tuple[int, int]:
        return int(os.environ["NRL_WORKER_RANK"]), int(os.environ["NRL_WORKER_WORLD_SIZE"])

    def add(self, x: int, *, scale: int = 1) -> int:
        self.value += x * scale
        return self.value

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = RayVirtualCluster([2], name=f"wg-{uuid.uuid4().hex[:8]}", num_cpus_per_bundle=0.5)
    yield c
    c.shutdown()


@pytest.fixture()
def namespace() -> str:
    return f"nrl-test-{uuid.uuid4().hex[:8]}"


def test_dispatch_and_state(cluster, namespace):
    import ray

    group = RayWorkerGroup(cluster, Counter, name_prefix="counter", namespace=namespace, actor_kwargs={"start": 10})
    try:
        assert group.world_size == 2 and group.preexisting == [False, False]
        assert ray.get(group.run_all_workers_single_data("rank")) == [(0, 2), (1, 2)]
        assert ray.get(group.run_all_workers_multiple_data("add", [1, 2], scale=[100, 1000])) == [110, 2010]
        assert group.get_all_worker_results(group.run_all_workers_sharded_data("add", [1, 1], scale=3)) == [113, 2013]
        assert ray.get(group.run_single_worker(1, "add", 0)) == 2013
        with pytest.raises(ValueError, match="3 shards for 2 workers"):
            group.run_all_workers_sharded_data("add", [1, 2, 3])
        with pytest.raises(ValueError, match="list 'scale' has 1 entries"):
            group.run_all_workers_multiple_data("add", [1, 2], scale=[1])

        # get-if-exists: building the group again attaches to the live actors (state kept)
        again = RayWorkerGroup(cluster, Counter, name_prefix="counter", namespace=namespace, actor_kwargs={"start": 0})
        assert again.preexisting == [True, True]
        assert ray.get(again.run_all_workers_single_data("add", 0)) == [113, 2013]
        assert ray.get(again.run_all_workers_single_data("pid")) == ray.get(group.run_all_workers_single_data("pid"))
        assert group.alive()
    finally:
        assert group.shutdown()
    with pytest.raises(LookupError, match="counter-0"):
        RayWorkerGroup.attach("counter", namespace)


def test_per_worker_kwargs_and_bundle_selection(cluster, namespace):
    import ray

    group = RayWorkerGroup(
        cluster,
        Counter,
        name_prefix="sel",
        namespace=namespace,
        actor_kwargs=[{"start": 1}],
        bundle_indices=[(0, 1)],
    )
    try:
        assert group.world_size == 1
        assert ray.get(group.run_all_workers_single_data("add", 0)) == [1]
    finally:
        group.shutdown(force=True)


def test_bad_arguments(cluster, namespace):
    with pytest.raises(ValueError, match="num_workers=3 exceeds the 2 bundles"):
        RayWorkerGroup(cluster, Counter, name_prefix="x", namespace=namespace, num_workers=3)
    with pytest.raises(ValueError, match="actor_kwargs has 1 entries for 2 workers"):
        RayWorkerGroup(cluster, Counter, name_prefix="x", namespace=namespace, actor_kwargs=[{}])
    with pytest.raises(ValueError, match="num_cpus_per_worker=2 does not fit"):
        RayWorkerGroup(cluster, Counter, name_prefix="x", namespace=namespace, num_cpus_per_worker=2)
    with pytest.raises(ValueError, match="name_prefix"):
        RayWorkerGroup(cluster, Counter, name_prefix="", namespace=namespace)
    with pytest.raises(ValueError, match=r"bundle index \(0, 5\)"):
        RayWorkerGroup(cluster, Counter, name_prefix="x", namespace=namespace, bundle_indices=[(0, 5)])


def test_attach_by_name(cluster, namespace):
    """``attach`` finds the detached actors by name (Policy tests do it from another process)."""
    import ray

    group = RayWorkerGroup(cluster, Counter, name_prefix="shared", namespace=namespace, actor_kwargs={"start": 7})
    try:
        ray.get(group.run_all_workers_single_data("add", 1))
        attached = RayWorkerGroup.attach("shared", namespace)
        assert attached.world_size == 2 and attached.preexisting == [True, True]
        assert ray.get(attached.run_all_workers_single_data("add", 1)) == [9, 9]
        with pytest.raises(LookupError, match="shared-0"):
            RayWorkerGroup.attach("shared", namespace + "-other")
    finally:
        group.shutdown()
