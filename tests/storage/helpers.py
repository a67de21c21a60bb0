"""Shared checks for the storage tests: exact (bitwise, type-strict) batch comparison."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch


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
