"""Packed broadcast through real 2-process gloo groups (spawned processes, 127.0.0.1).

Two kinds of group: the default ``torch.distributed`` group from ``init_process_group``, and the
stateless :class:`BroadcastGroup`, created in processes that already run a default group of
their own (as trainer workers do), which must stay untouched.
"""

from __future__ import annotations

import datetime
import queue as queue_mod
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nrl_tasks.utils.collective import create_broadcast_group, find_free_port
from nrl_tasks.utils.packed_tensor import packed_broadcast_consumer, packed_broadcast_producer
from nrl_tasks.utils.refit import RefitInfo, weights_checksum
from tests.utils.test_packed_tensor import mixed_params

# (buffer_size_bytes, use_legacy_packing, producer buffers, consumer buffers, src)
CASES = [
    (1 << 20, False, 2, 2, 0),
    (64, False, 1, 3, 0),
    (256, True, 3, 1, 0),
    (7, True, 2, 2, 0),
    (4096, False, 2, 1, 1),  # rank 1 sends: src is the rank within the group
]


def _params() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    big = torch.empty(3 << 20, dtype=torch.uint8).random_(0, 256, generator=gen).view(torch.bfloat16).view(1024, -1)
    return [*mixed_params(3), ("big.bf16", big)]


def _run_cases(group: Any, rank: int, results: Any, label: str) -> None:
    params = _params()
    for case_id, (size, legacy, prod_n, cons_n, src) in enumerate(CASES):
        info = RefitInfo.build(params, size, weights_version=case_id)
        if rank == src:
            packed_broadcast_producer(iter(params), group, src, lambda item: item[1], buffer_size_bytes=size,
                                      num_buffers=prod_n, use_legacy_packing=legacy)
            results.put((rank, label, case_id, "sent", weights_checksum(params)))
        else:
            got: list[tuple[str, torch.Tensor]] = []
            packed_broadcast_consumer(info.consumer_iter(), group, src,
                                      lambda batch: got.extend((n, t.clone()) for n, t in batch),
                                      buffer_size_bytes=size, num_buffers=cons_n, use_legacy_packing=legacy)
            results.put((rank, label, case_id, "received", weights_checksum(got)))


def _worker(rank: int, ports: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    # 1. the default torch.distributed group of both processes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports['world']}", rank=rank, world_size=2, timeout=timeout)
    _run_cases(dist.group.WORLD, rank, results, "default")
    dist.destroy_process_group()
    # 2. a stateless group between processes that each run a default (data-parallel) group of their own
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports['own'][rank]}", rank=0, world_size=1, timeout=timeout)
    group = create_broadcast_group("127.0.0.1", ports["stateless"], rank, 2, timeout_s=60)
    try:
        _run_cases(group, rank, results, "stateless")
    finally:
        group.close()
    value = torch.ones(1)
    dist.all_reduce(value)  # the default group still works and is still of size 1
    results.put((rank, "own-default", -1, "check", (dist.get_world_size(), float(value))))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results() -> list[tuple]:
    """Run every case over both kinds of group in one pair of spawned processes."""
    ports = {"world": find_free_port(), "stateless": find_free_port(), "own": [find_free_port(), find_free_port()]}
    expected = 2 * 2 * len(CASES) + 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, ports, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    out: list[tuple] = []
    try:
        while len(out) < expected:
            try:
                out.append(results.get(timeout=120))
            except queue_mod.Empty:
                raise AssertionError(f"workers produced {len(out)}/{expected} results; exit codes {[p.exitcode for p in procs]}") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return out


def _check(results: list[tuple], kind_of_group: str) -> None:
    mine = [r for r in results if r[1] == kind_of_group]
    sent = {case: digest for _, _, case, kind, digest in mine if kind == "sent"}
    received = {case: digest for _, _, case, kind, digest in mine if kind == "received"}
    assert sorted(sent) == sorted(received) == list(range(len(CASES)))
    for case in sent:
        assert received[case] == sent[case], f"case {CASES[case]} over the {kind_of_group} group is not bit-exact"


def test_round_trips_over_default_process_group(gloo_results):
    _check(gloo_results, "default")


def test_round_trips_over_stateless_group_leave_default_group_alone(gloo_results):
    _check(gloo_results, "stateless")
    assert [r[4] for r in gloo_results if r[1] == "own-default"] == [(1, 1.0), (1, 1.0)]
