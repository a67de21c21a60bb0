"""Batch columns <-> Arrow columns: picks the encoding of each column and builds the schema.

See ``storage.tensor_codec`` (tensors, ragged tensor lists) and ``storage.pycodec`` (Python
lists) for the layouts. Every column's Arrow field carries ``nrl.kind`` / ``nrl.dtype`` /
``nrl.shape`` metadata, so a shard file describes itself even without its manifest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import pyarrow as pa
import torch

from storage.manifest import ColumnSpec
from storage.pycodec import decode_json, encode_pylist
from storage.tensor_codec import (
    BufferBase,
    decode_tensor,
    decode_tensor_list,
    dtype_from_name,
    dtype_name,
    storage_of,
    tensor_array,
    tensor_list_array,
    tensor_list_layout,
)

__all__ = ["EncodedColumn", "decode_column", "encode_columns", "count_rows"]


@dataclass
class EncodedColumn:
    """One column ready to be cut into shards."""

    spec: ColumnSpec
    field: pa.Field
    tensor: Optional[torch.Tensor] = None  # kind "tensor": sliced per shard without copies
    array: Optional[pa.Array] = None  # other kinds: the whole column, sliced per shard

    def rows(self, start: int, stop: int) -> pa.Array:
        """Arrow array of rows ``[start, stop)``."""
        if self.tensor is not None:
            return tensor_array(self.tensor[start:stop], self.spec.name)
        assert self.array is not None  # invariant of encode_columns
        return self.array.slice(start, stop - start)


def count_rows(batch: Mapping[str, Any]) -> int:
    """Rows of a batch; ``ValueError`` naming the columns when they disagree."""
    sizes: dict[str, int] = {}
    for key, value in batch.items():
        if not isinstance(key, str):
            raise TypeError(f"column names must be str, got {key!r}")
        if isinstance(value, torch.Tensor):
            if value.ndim == 0:
                raise ValueError(f"column {key!r} is a 0-d tensor; the batch must be on dim 0")
            sizes[key] = int(value.shape[0])
        elif isinstance(value, list):
            sizes[key] = len(value)
        else:
            raise TypeError(
                f"column {key!r} holds a {type(value).__name__}; expected a torch.Tensor or a list"
            )
    if len(set(sizes.values())) > 1:
        raise ValueError(f"columns have different numbers of rows: {sizes}")
    return next(iter(sizes.values()), 0)


def _field(name: str, arrow_type: pa.DataType, spec: ColumnSpec) -> pa.Field:
    meta = {"nrl.kind": spec.kind}
    if spec.dtype is not None:
        meta["nrl.dtype"] = spec.dtype
    if spec.shape is not None:
        meta["nrl.shape"] = json.dumps(spec.shape)
    return pa.field(name, arrow_type, nullable=spec.kind != "tensor", metadata=meta)


def _encode(key: str, value: Any) -> EncodedColumn:
    if isinstance(value, torch.Tensor):
        storage, _ratio = storage_of(value.dtype, key)
        sample = tensor_array(value[:0], key)
        spec = ColumnSpec(
            name=key,
            kind="tensor",
            dtype=dtype_name(value.dtype),
            shape=list(value.shape[1:]),
            storage=str(storage),
            arrow_type=str(sample.type),
        )
        return EncodedColumn(spec, _field(key, sample.type, spec), tensor=value)
    layout = tensor_list_layout(value)
    if layout is not None:
        dtype, trailing = layout
        arr = tensor_list_array(value, key)
        spec = ColumnSpec(
            name=key,
            kind="tensor_list",
            dtype=dtype_name(dtype),
            shape=list(trailing),
            storage=str(storage_of(dtype, key)[0]),
            arrow_type=str(arr.type),
        )
        return EncodedColumn(spec, _field(key, arr.type, spec), array=arr)
    kind, arr = encode_pylist(value, key)
    spec = ColumnSpec(name=key, kind=kind, arrow_type=str(arr.type))  # type: ignore[arg-type]
    return EncodedColumn(spec, _field(key, arr.type, spec), array=arr)


def encode_columns(batch: Mapping[str, Any]) -> tuple[int, list[EncodedColumn], pa.Schema]:
    """``(rows, columns, schema)`` for a batch; raises before anything is written."""
    rows = count_rows(batch)
    columns = [_encode(key, value) for key, value in batch.items()]
    schema = pa.schema([c.field for c in columns], metadata={"nrl.format": "nrl-batch/1"})
    return rows, columns, schema


def decode_column(
    spec: ColumnSpec, chunks: Sequence[pa.Array], base: Optional[BufferBase]
) -> torch.Tensor | list[Any]:
    """A batch column from the chunks of one Arrow column (one shard)."""
    if spec.kind in ("tensor", "tensor_list"):
        if spec.dtype is None or spec.shape is None or spec.storage is None:
            raise ValueError(f"column {spec.name!r}: manifest lacks dtype/shape/storage")
        dtype = dtype_from_name(spec.dtype)
        decode = decode_tensor if spec.kind == "tensor" else decode_tensor_list
        return decode(chunks, dtype, spec.shape, spec.storage, base, spec.name)
    if spec.kind == "json":
        return decode_json(chunks)
    out: list[Any] = []
    for arr in chunks:
        out.extend(arr.to_pylist())
    return out
