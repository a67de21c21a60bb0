"""all_gather over a real 2-process gloo group (spawned processes, FileStore rendezvous)."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

WORLD = 2


def _local_batch(rank: int) -> BatchedDataDict:
    """Rank 0: 2 rows, ids 3 wide; rank 1: 3 rows, ids 5 wide (jagged rows and widths)."""
    rows, width = (2, 3) if rank == 0 else (3, 5)
    base = 100 * (rank + 1)
    return BatchedDataDict(
        {
            "input_ids": torch.arange(base, base + rows * width).reshape(rows, width),
            "logprobs": torch.full((rows, width), -0.5 * (rank + 1), dtype=torch.bfloat16),
            "token_mask": torch.ones(rows, width, dtype=torch.bool),
            "hidden": torch.full((rows, width, 2), float(rank), dtype=torch.float64),
            "rewards": torch.arange(rows, dtype=torch.float32) + rank,
            "text": [f"r{rank}-{i}" for i in range(rows)],
            "messages": [[{"role": "user", "content": f"q{rank}{i}"}] for i in range(rows)],
        }
    )


def _tiny_view_batch(rank: int) -> BatchedDataDict:
    """Rank 0: one row, x[:, 0] of [1, S] tensors; rank 1: zero rows, x[:, 0] of [0, S] ones."""
    rows = 1 - rank
    return BatchedDataDict({
        "reward": torch.arange(7, 12, dtype=torch.float32).reshape(1, 5)[:rows, 0],
        "ids": torch.arange(12).reshape(1, 3, 4)[:rows, :, 0],  # [rows, 3], strides (12, 4)
    })


def _as_plain(batch: BatchedDataDict) -> dict[str, Any]:
    return {k: (v.float().tolist(), str(v.dtype)) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def _worker(rank: int, store_path: str, results: Any) -> None:
    try:
        store = dist.FileStore(store_path, WORLD)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
        out: dict[str, Any] = {"gathered": _as_plain(_local_batch(rank).all_gather(None))}
        # a rank without columns contributes no rows
        empty_or_not = (BatchedDataDict() if rank == 1 else
                        BatchedDataDict({"x": ["only0"], "t": torch.tensor([[1.5, 2.5]])}))
        out["partial"] = _as_plain(empty_or_not.all_gather(dist.group.WORLD))
        # 0- and 1-element views whose stride is not 1 (x[:, 0] of a [1, S] tensor)
        out["tiny_views"] = _as_plain(_tiny_view_batch(rank).all_gather(None))
        # a dtype mismatch raises the same error on every rank instead of hanging
        bad = BatchedDataDict({"x": torch.zeros(1, dtype=torch.float32 if rank else torch.int64)})
        try:
            bad.all_gather(None)
            out["mismatch"] = None
        except ValueError as e:
            out["mismatch"] = str(e)
        dist.destroy_process_group()
        results.put((rank, out))
    except BaseException:  # report, so the parent fails with the traceback instead of timing out
        results.put((rank, {"error": traceback.format_exc()}))


@pytest.fixture(scope="module")
def gathered(tmp_path_factory) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = str(tmp_path_factory.mktemp("gloo") / "store")
    with pytest.MonkeyPatch.context() as patch:  # the spawned ranks inherit these; restored after
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setenv("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        procs = [ctx.Process(target=_worker, args=(r, store, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        out = dict(results.get(timeout=120) for _ in range(WORLD))
        for p in procs:
            p.join(timeout=30)
    for rank, res in out.items():
        assert "error" not in res, f"rank {rank} failed:\n{res['error']}"
    return out


def test_all_gather_matches_from_batches_on_every_rank(gathered):
    expected = _as_plain(BatchedDataDict.from_batches([_local_batch(0), _local_batch(1)]))
    for rank in range(WORLD):
        assert gathered[rank]["gathered"] == expected


def test_all_gather_jagged_shapes_and_dtypes(gathered):
    g = gathered[0]["gathered"]
    ids, dtype = g["input_ids"]
    assert dtype == "torch.int64" and len(ids) == 5 and all(len(r) == 5 for r in ids)
    assert ids[0] == [100, 101, 102, 0, 0] and ids[2] == [200, 201, 202, 203, 204]
    assert g["logprobs"][1] == "torch.bfloat16" and g["logprobs"][0][0] == [-0.5] * 3 + [0.0] * 2
    assert g["token_mask"][1] == "torch.bool" and g["token_mask"][0][1] == [1.0] * 3 + [0.0] * 2
    assert len(g["hidden"][0][0]) == 5 and g["hidden"][0][4][0] == [1.0, 1.0]
    assert g["rewards"][0] == [0.0, 1.0, 1.0, 2.0, 3.0]
    assert g["text"] == ["r0-0", "r0-1", "r1-0", "r1-1", "r1-2"]
    assert g["messages"][3] == [{"role": "user", "content": "q11"}]


def test_all_gather_rank_without_columns(gathered):
    for rank in range(WORLD):
        assert gathered[rank]["partial"] == {"x": ["only0"], "t": ([[1.5, 2.5]], "torch.float32")}


def test_all_gather_tiny_strided_views(gathered):
    for rank in range(WORLD):
        assert gathered[rank]["tiny_views"] == {"reward": ([7.0], "torch.float32"),
                                                "ids": ([[0.0, 4.0, 8.0]], "torch.int64")}


def test_all_gather_schema_mismatch_raises_everywhere(gathered):
    for rank in range(WORLD):
        msg = gathered[rank]["mismatch"]
        assert msg is not None and "column 'x'" in msg and "rank 1" in msg
