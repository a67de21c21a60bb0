"""Column helpers for ``BatchedDataDict``: row counts, row selection, row-wise concatenation.

A column is a ``torch.Tensor`` with the batch on dim 0 or a ``list`` with one element per row.
Errors name the column (``key``) and the offending shapes, dtypes or types.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import numpy as np
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


def _row_index(i: Any, size: int) -> int:
    """One row id: an int-like (``int``, numpy or 0-d torch integer) in ``[0, size)``."""
    if isinstance(i, (bool, np.bool_)) or (isinstance(i, torch.Tensor) and i.dtype == torch.bool):
        raise ValueError(f"index {i!r} is a bool; pass row ids (ints) or a bool torch.Tensor mask")
    try:
        row = operator.index(i)
    except TypeError:
        raise ValueError(f"index {i!r} is not an integer (got {type(i).__name__})") from None
    if not 0 <= row < size:
        raise ValueError(f"index {row!r} out of range for a batch of {size} rows")
    return row


def row_indices(indices: Any, size: int) -> list[int]:
    """Row ids in ``[0, size)`` from what ``BatchedDataDict.select_indices`` accepts.

    Accepted: a list, tuple, ``range`` or other sequence of ints (``np.integer`` too); a 1-D
    integer ``numpy`` array or ``torch`` tensor of any int dtype (as NeMo-RL, which indexes with
    them); a bool ``torch`` mask of ``size`` entries; an integer scalar (``int``, ``np.integer``,
    0-d array or tensor), which selects one row and, unlike NeMo-RL, keeps the batch dim.
    Everything else raises ``ValueError`` naming the dtype or type: float, complex, bool and
    string arrays (a numpy bool mask too: pass ``np.flatnonzero(mask)``), arrays of rank >= 2,
    sets; and ids outside ``[0, size)`` (NeMo-RL would wrap negative ones).
    """
    if isinstance(indices, torch.Tensor):
        if indices.dtype == torch.bool:
            if indices.shape != (size,):
                raise ValueError(f"bool mask of shape {tuple(indices.shape)} for {size} rows")
            return indices.nonzero().flatten().tolist()
        if indices.ndim > 1 or indices.is_floating_point() or indices.is_complex():
            raise ValueError(f"indices must be a 1-D integer tensor, got {indices.dtype} "
                             f"of shape {tuple(indices.shape)}")
        candidates = indices.reshape(-1).tolist()
    elif isinstance(indices, np.ndarray):
        if indices.ndim > 1 or indices.dtype.kind not in "iu":
            hint = "; for a bool mask use np.flatnonzero(mask)" if indices.dtype.kind == "b" else ""
            raise ValueError(f"indices must be a 1-D integer numpy array, got dtype "
                             f"{indices.dtype} of shape {indices.shape}{hint}")
        candidates = indices.reshape(-1).tolist()
    elif isinstance(indices, (int, np.integer)) and not isinstance(indices, (bool, np.bool_)):
        candidates = [indices]
    elif isinstance(indices, Sequence) and not isinstance(indices, (str, bytes)):
        candidates = indices
    else:
        raise ValueError(f"indices must be ints as a list, range, numpy array or torch tensor, "
                         f"got {type(indices).__name__}")
    return [_row_index(i, size) for i in candidates]


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
