"""Python list columns <-> Arrow arrays, exactly (no pickle).

Two encodings, chosen per column:

- ``"arrow"``: a native Arrow column when Arrow gives back exactly what it was given: flat
  lists of ``str``, ``int`` (int64 range), ``float``, ``bool``, ``bytes`` (each with ``None``),
  and homogeneous nested lists/dicts of them (dicts as structs). "Exactly" is checked: the
  array is converted back and compared strictly (types, dict key order, ``-0.0``, NaN); any
  difference (e.g. ``[1, 2.5]``, dicts with different keys, tuples) falls back to JSON.
- ``"json"``: one JSON string per row. Values JSON lacks are tagged objects with the key
  ``"__nrl__"``: ``{"__nrl__": "tensor", "dtype", "shape", "b64"}`` (raw bytes, base64),
  ``{"__nrl__": "tuple", "items"}``, ``{"__nrl__": "bytes", "b64"}`` and
  ``{"__nrl__": "dict", "items": [[key, value], ...]}`` for dicts whose keys are not all
  strings or that contain ``"__nrl__"`` themselves. Floats keep NaN/Infinity as JSON's
  common extension. This is the home of message logs (lists of dicts holding tensors).

Only exact built-in types are accepted (``type(v) is float``, not numpy scalars): anything
else raises ``TypeError`` naming the column and row, since it could not come back as itself.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any, Sequence

import pyarrow as pa
import torch

from storage.tensor_codec import dtype_from_name, dtype_name

__all__ = ["TAG", "decode_json", "encode_json", "encode_pylist", "strict_equal"]

TAG = "__nrl__"
_SCALARS = {
    str: pa.string(),
    bool: pa.bool_(),
    int: pa.int64(),
    float: pa.float64(),
    bytes: pa.binary(),
}
_LARGE = {str: pa.large_string(), bytes: pa.large_binary()}


def strict_equal(a: Any, b: Any) -> bool:
    """Equality that also requires equal types, dict key order, float bits (NaN == NaN).

    >>> strict_equal([1, {"a": 2.0}], [1, {"a": 2}]), strict_equal(float("nan"), float("nan"))
    (False, True)
    """
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(strict_equal(a[k], b[k]) for k in a)
    return a == b


def _flat_scalar_array(values: Sequence[Any], kind: type) -> pa.Array | None:
    arrow_type = _SCALARS[kind]
    if kind in _LARGE:
        total = sum(len(v) for v in values if v is not None)
        if total * (4 if kind is str else 1) >= 2**31 - 1:
            arrow_type = _LARGE[kind]
    try:
        arr = pa.array(values, type=arrow_type, from_pandas=False)
    except (OverflowError, pa.ArrowInvalid, pa.ArrowTypeError):
        return None  # e.g. ints beyond int64
    return arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr


def _nested_array(values: Sequence[Any]) -> pa.Array | None:
    try:
        arr = pa.array(values, from_pandas=False)
    except (OverflowError, pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    if isinstance(arr, pa.ChunkedArray):
        return None
    return arr if strict_equal(arr.to_pylist(), list(values)) else None


def encode_pylist(values: Sequence[Any], key: str) -> tuple[str, pa.Array]:
    """``(kind, array)`` for a list column: ``"arrow"`` when exact, else ``"json"``."""
    kinds = {type(v) for v in values}
    kinds.discard(type(None))
    arr = None
    if not kinds:
        arr = pa.nulls(len(values))
    elif len(kinds) == 1 and next(iter(kinds)) in _SCALARS:
        arr = _flat_scalar_array(values, next(iter(kinds)))
    elif kinds <= {list, dict} and not _holds_special(values):
        arr = _nested_array(values)
    if arr is not None:
        return "arrow", arr
    return "json", encode_json(values, key)


def _holds_special(values: Any) -> bool:
    """Whether a nested value holds anything Arrow would not give back as itself."""
    stack = list(values)
    while stack:
        v = stack.pop()
        t = type(v)
        if t is list:
            stack.extend(v)
        elif t is dict:
            stack.extend(v.values())
        elif v is not None and t not in _SCALARS:
            return True
    return False


# --------------------------------------------------------------------------- JSON
def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _to_jsonable(v: Any, key: str, row: int) -> Any:
    t = type(v)
    if v is None or t is str or t is int or t is bool or t is float:
        return v
    if t is list:
        return [_to_jsonable(x, key, row) for x in v]
    if t is dict:
        if TAG not in v and all(type(k) is str for k in v):
            return {k: _to_jsonable(x, key, row) for k, x in v.items()}
        items = [[_to_jsonable(k, key, row), _to_jsonable(x, key, row)] for k, x in v.items()]
        return {TAG: "dict", "items": items}
    if t is tuple:
        return {TAG: "tuple", "items": [_to_jsonable(x, key, row) for x in v]}
    if t is bytes:
        return {TAG: "bytes", "b64": base64.b64encode(v).decode("ascii")}
    if isinstance(v, torch.Tensor):
        if v.layout != torch.strided:
            raise TypeError(f"column {key!r} row {row}: sparse tensors cannot be stored")
        return {
            TAG: "tensor",
            "dtype": dtype_name(v.dtype),
            "shape": list(v.shape),
            "b64": base64.b64encode(_tensor_bytes(v)).decode("ascii"),
        }
    raise TypeError(
        f"column {key!r} row {row} holds a {t.__module__}.{t.__qualname__}; storable values are "
        "None, str, int, float, bool, bytes, list, tuple, dict and torch tensors"
    )


def _from_jsonable(v: Any) -> Any:
    if type(v) is list:
        return [_from_jsonable(x) for x in v]
    if type(v) is not dict:
        return v
    tag = v.get(TAG)
    if tag is None:
        return {k: _from_jsonable(x) for k, x in v.items()}
    if tag == "tensor":
        dtype = dtype_from_name(v["dtype"])
        shape = v["shape"]
        if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"JSON tensor shape must be a list of non-negative ints, got {shape!r}")
        expected = math.prod(shape) * dtype.itemsize
        b64 = v["b64"]
        if type(b64) is not str or len(b64) != 4 * ((expected + 2) // 3):  # checked before decoding
            raise ValueError(
                f"JSON tensor payload of {len(b64) if type(b64) is str else type(b64).__name__} base64 chars does not "
                f"hold shape {shape} x {dtype} = {expected} bytes"
            )
        raw = bytearray(base64.b64decode(b64, validate=True))
        if len(raw) != expected:
            raise ValueError(f"JSON tensor payload holds {len(raw)} bytes, shape {shape} x {dtype} needs {expected}")
        if not raw:
            return torch.empty(shape, dtype=dtype)  # zero elements: nothing uninitialised
        return torch.frombuffer(raw, dtype=dtype).reshape(shape)
    if tag == "tuple":
        return tuple(_from_jsonable(x) for x in v["items"])
    if tag == "bytes":
        return base64.b64decode(v["b64"])
    if tag == "dict":
        return {_from_jsonable(k): _from_jsonable(x) for k, x in v["items"]}
    raise ValueError(f"unknown tagged value {tag!r} in a JSON column")


def encode_json(values: Sequence[Any], key: str) -> pa.Array:
    """One JSON string per row (``large_string`` when big)."""
    rows = [
        None if v is None else json.dumps(_to_jsonable(v, key, i), ensure_ascii=False)
        for i, v in enumerate(values)
    ]
    total = sum(len(r) for r in rows if r is not None)
    arrow_type = pa.large_string() if total * 4 >= 2**31 - 1 else pa.string()
    return pa.array(rows, type=arrow_type)


def decode_json(chunks: Sequence[pa.Array]) -> list[Any]:
    """Rows of a JSON column."""
    out: list[Any] = []
    for arr in chunks:
        out.extend(None if s is None else _from_jsonable(json.loads(s)) for s in arr.to_pylist())
    return out
