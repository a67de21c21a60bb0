"""Column helpers for ``BatchedDataDict``: row counts, row selection, row-wise concatenation.

A column is a ``torch.Tensor`` with the batch on dim 0 or a ``list`` with one element per row.
Errors name the column (``key``) and the offending shapes, dtypes or types.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def rows_of(key: str, value: Any) -> int:
    """Rows of column ``key``: ``shape[0]`` of a tensor, ``len`` of a list."""
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            raise ValueError(f"column {key!r} is a 0-d tensor; the batch must be on dim 0")
        return value.shape[0]
    if isinstance(value, list):
        return len(value)
    raise TypeError(f"column {key!r} holds a {type(value).__name__}; expected a tensor or a list")


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is an ``int >= 1`` (not a bool); else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def take_rows(value: torch.Tensor | list, rows: Sequence[int]) -> torch.Tensor | list:
    """Rows ``rows`` of one column, in that order (a copy; repeats allowed)."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, torch.as_tensor(rows, dtype=torch.long, device=value.device))
    return [value[i] for i in rows]


def concat_column(key: str, parts: Sequence[Any], pad_value: float) -> torch.Tensor | list:
    """Concatenate one column's pieces row-wise.

    Lists and 1-D tensors are concatenated; tensors of rank >= 2 are right-padded on dim 1 to
    the widest piece with ``pad_value`` (dtype kept). All pieces must be lists, or tensors of
    one dtype and rank whose dims after 1 agree.
    """
    if all(isinstance(p, list) for p in parts):
        return [item for p in parts for item in p]
    if not all(isinstance(p, torch.Tensor) for p in parts):
        kinds = sorted({type(p).__name__ for p in parts})
        raise TypeError(f"column {key!r} mixes {kinds} across batches; expected all tensors or lists")
    dtypes, ndims = {p.dtype for p in parts}, {p.ndim for p in parts}
    if len(dtypes) > 1 or len(ndims) > 1:
        shapes = [(tuple(p.shape), str(p.dtype)) for p in parts]
        raise ValueError(f"column {key!r} has mismatched dtypes or ranks across batches: {shapes}")
    if ndims == {0}:
        raise ValueError(f"column {key!r} is a 0-d tensor; the batch must be on dim 0")
    if ndims == {1}:
        return torch.cat(list(parts))
    if len({tuple(p.shape[2:]) for p in parts}) > 1:
        raise ValueError(
            f"column {key!r}: dims after 1 must match across batches, got "
            f"{[tuple(p.shape) for p in parts]}"
        )
    width = max(p.shape[1] for p in parts)
    if all(p.shape[1] == width for p in parts):
        return torch.cat(list(parts))
    first = parts[0]
    out = torch.full(
        (sum(p.shape[0] for p in parts), width, *first.shape[2:]),
        pad_value, dtype=first.dtype, device=first.device,
    )
    row = 0
    for p in parts:
        out[row : row + p.shape[0], : p.shape[1]] = p
        row += p.shape[0]
    return out
