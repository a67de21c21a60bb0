"""Stateless broadcast groups: rendezvous, broadcasts, and deadlines that raise instead of hanging."""

from __future__ import annotations

import queue as queue_mod
import time
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from nrl_tasks.utils.collective import (
    BroadcastGroup,
    CollectiveError,
    CollectiveTimeoutError,
    create_broadcast_group,
    find_free_port,
    get_node_ip,
    start_broadcast,
)
from nrl_tasks.utils.packed_tensor import packed_broadcast_consumer

DEADLINE_S = 2.0


def _worker(rank: int, ports: list[int], results: Any, release: Any) -> None:
    # 1. plain broadcasts, sync and async, both directions
    group = create_broadcast_group("127.0.0.1", ports[0], rank, 2, timeout_s=30)
    x = torch.full((5,), float(rank))
    group.broadcast(x, src=1)  # rank 1 sends
    y = torch.arange(4, dtype=torch.int64) * (rank + 1)
    group.broadcast_async(y, 0).wait()
    group.barrier()
    results.put(("broadcast", rank, (group.rank, group.world_size, x.tolist(), y.tolist())))
    group.close()
    group.close()  # idempotent
    # 2. a partner that joins and then never sends: the receiver must raise at the deadline
    group = create_broadcast_group("127.0.0.1", ports[1], rank, 2, timeout_s=DEADLINE_S)
    if rank == 0:
        release.wait(60)
        group.close()
        return
    start = time.monotonic()
    try:
        packed_broadcast_consumer(iter([("w", ((4,), torch.float32))]), group, 0, lambda batch: None)
        outcome: tuple = ("no error", "")
    except Exception as exc:  # noqa: BLE001 - reported to the parent for checking
        outcome = (type(exc).__name__, str(exc))
    results.put(("silent", rank, (*outcome, time.monotonic() - start)))
    group.close()


@pytest.fixture(scope="module")
def two_process_results() -> dict[tuple[str, int], Any]:
    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Event()
    ports = [find_free_port(), find_free_port()]
    procs = [ctx.Process(target=_worker, args=(rank, ports, results, release)) for rank in (0, 1)]
    for p in procs:
        p.start()
    out: dict[tuple[str, int], Any] = {}
    try:
        while len(out) < 3:
            try:
                kind, rank, value = results.get(timeout=90)
            except queue_mod.Empty:
                raise AssertionError(f"workers hung; got {sorted(out)}") from None
            out[(kind, rank)] = value
            if kind == "silent":
                release.set()
    finally:
        release.set()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return out


def test_two_process_broadcasts(two_process_results):
    for rank in (0, 1):
        assert two_process_results[("broadcast", rank)] == (rank, 2, [1.0] * 5, [0, 1, 2, 3])


def test_partner_that_never_sends_raises_within_deadline(two_process_results):
    kind, message, elapsed = two_process_results[("silent", 1)]
    assert kind == "CollectiveTimeoutError", message
    assert "timeout 2 s" in message and "src 0" in message
    assert elapsed < 30  # raised at the deadline, did not hang


def test_partner_that_never_joins_raises():
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"rendezvous .*rank 0/2"):
        create_broadcast_group("127.0.0.1", find_free_port(), 0, 2, timeout_s=1.5)
    assert time.monotonic() - start < 30


def test_no_host_to_join_raises():
    with pytest.raises(CollectiveTimeoutError, match="rank 1/2"):
        create_broadcast_group("127.0.0.1", find_free_port(), 1, 2, timeout_s=1.0)


def test_single_rank_group_and_validation():
    group = create_broadcast_group("127.0.0.1", find_free_port(), 0, 1, timeout_s=5)
    assert isinstance(group, BroadcastGroup) and group.device == torch.device("cpu")
    x = torch.arange(3.0)
    group.broadcast(x, 0)
    assert x.tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="src=1"):
        group.broadcast(x, 1)
    with pytest.raises(ValueError, match="contiguous"):
        group.broadcast(torch.ones(3, 3).t(), 0)
    with pytest.raises(TypeError, match="torch.Tensor"):
        group.broadcast([1, 2], 0)  # type: ignore[arg-type]
    group.close()
    with pytest.raises(CollectiveError, match="closed"):
        group.broadcast(x, 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": 0, "world_size": 0}, "world_size"),
        ({"rank": 0, "world_size": 1, "backend": "mpi"}, "backend"),
        ({"rank": 0, "world_size": 1, "timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        create_broadcast_group("127.0.0.1", find_free_port(), **kwargs)


def test_ports_and_node_ip(monkeypatch):
    port = find_free_port()
    assert 0 < port < 65536
    monkeypatch.delenv("NRL_NODE_IP", raising=False)
    assert get_node_ip() == "127.0.0.1"
    monkeypatch.setenv("NRL_NODE_IP", "10.1.2.3")
    assert get_node_ip() == "10.1.2.3"


def test_start_broadcast_rejects_objects_without_broadcast():
    with pytest.raises(TypeError, match="ProcessGroup"):
        start_broadcast(object(), torch.ones(1), 0)
