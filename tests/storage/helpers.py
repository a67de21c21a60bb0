"""Shared pieces of the storage tests: batches of every column kind, exact comparison."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict


def same_value(a: Any, b: Any, where: str = "value") -> None:
    """Assert ``a`` and ``b`` are the same: types, dtypes, shapes, bits, dict key order."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor became {type(b).__name__}"
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} -> {b.dtype}"
        assert tuple(a.shape) == tuple(b.shape), f"{where}: shape {tuple(a.shape)} -> {tuple(b.shape)}"
        if a.numel():
            ab = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(ab, bb), f"{where}: tensor bits differ"
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} -> {type(b).__name__}"
    if isinstance(a, float):
        if math.isnan(a):
            assert math.isnan(b), f"{where}: nan -> {b!r}"
        else:
            assert a == b and math.copysign(1, a) == math.copysign(1, b), f"{where}: {a!r} -> {b!r}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} -> {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same_value(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} -> {list(b)}"
        for k in a:
            same_value(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, f"{where}: {a!r} -> {b!r}"


def same_batch(expected: Mapping[str, Any], got: Mapping[str, Any]) -> None:
    """Assert two batches hold the same columns, in the same order, with the same values."""
    assert list(expected.keys()) == list(got.keys()), f"columns {list(expected)} -> {list(got)}"
    for key in expected:
        same_value(expected[key], got[key], f"column {key!r}")


ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.complex128,
    *[getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
                                  "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
      if hasattr(torch, n)],
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits of ``dtype`` (NaNs, infinities, subnormals included); bools are 0/1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    n = int(torch.tensor(shape).prod()) if shape else 1
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def message_logs(rows: int) -> list:
    return [
        [
            {"role": "user", "content": f"what is {i} + 1?", "token_ids": torch.arange(i + 2)},
            {"role": "assistant", "content": str(i + 1), "token_ids": torch.tensor([i], dtype=torch.int32)},
        ]
        for i in range(rows)
    ]


def every_kind_batch(rows: int = 5) -> BatchedDataDict:
    cols = {
        "ids_1d": torch.arange(rows),
        "input_ids": torch.arange(rows * 7).reshape(rows, 7),
        "hidden": random_tensor((rows, 2, 3), torch.bfloat16, 1),
        "token_mask": random_tensor((rows, 7), torch.bool, 2),
        "empty_inner": torch.zeros(rows, 0, 4),
        "text": [f"row {i} ✓" if i % 3 else None for i in range(rows)],
        "ints": [i * 10**15 if i % 2 else None for i in range(rows)],
        "huge_ints": [2**80 + i for i in range(rows)],
        "floats": [[float("nan"), -0.0, float("inf"), 1.5, None][i % 5] for i in range(rows)],
        "flags": [i % 2 == 0 for i in range(rows)],
        "blobs": [bytes([i, 0, 255]) for i in range(rows)],
        "mixed": [[1, "a", 2.5, None, True][i % 5] for i in range(rows)],
        "nested": [{"a": i, "b": [float(i), 2.0], "c": {"d": "x"}} for i in range(rows)],
        "ragged_dicts": [{"a": i} if i % 2 else {"b": str(i)} for i in range(rows)],
        "tuples": [(i, "x") for i in range(rows)],
        "message_log": message_logs(rows),
        "ragged": [torch.arange(i, dtype=torch.int64) if i != 2 else None for i in range(rows)],
        "ragged_bf16": [random_tensor((i + 1, 3), torch.bfloat16, i) for i in range(rows)],
        "ragged_mixed_dtypes": [torch.zeros(2, dtype=torch.int32 if i % 2 else torch.int64) for i in range(rows)],
        "nones": [None] * rows,
    }
    for dtype in ALL_DTYPES:
        cols[f"t_{dtype}"] = random_tensor((rows, 3), dtype, seed=hash(str(dtype)) % 1000)
    return BatchedDataDict(cols)
