"""Python list columns: which encoding is chosen, and the JSON tags' edge cases."""

from __future__ import annotations

import json

import pytest
import torch

from storage.pycodec import TAG, decode_json, encode_json, encode_pylist, strict_equal
from tests.storage.helpers import same_value


@pytest.mark.parametrize(
    "values,kind",
    [
        (["a", None], "arrow"),
        ([1, None, -(2**63)], "arrow"),
        ([2**63], "json"),  # beyond int64
        ([1, 2.5], "json"),  # Arrow would turn 1 into 1.0
        ([True, 1], "json"),
        ([[1, 2], [], None], "arrow"),
        ([{"a": 1}, {"a": None}], "arrow"),
        ([{"a": 1}, {"b": 1}], "json"),  # Arrow would add the missing keys as None
        ([{"a": 1, "b": 2}, {"b": 2, "a": 1}], "json"),  # key order must survive
        ([(1, 2)], "json"),
        ([[torch.tensor(1)]], "json"),
        ([None, None], "arrow"),
        ([], "arrow"),
    ],
)
def test_encoding_choice_and_round_trip(values, kind):
    got_kind, arr = encode_pylist(values, "col")
    assert got_kind == kind
    back = decode_json([arr]) if kind == "json" else arr.to_pylist()
    same_value(values, back)


def test_json_tags_escape_and_exotic_keys():
    rows = [
        {TAG: "tensor", "dtype": "float32"},  # a user dict that looks like a tag
        {1: "int key", (2, "t"): b"bytes", None: [1.5, float("-inf")]},
        [torch.tensor([[1.0, -0.0]], dtype=torch.float16), torch.zeros(0, 3, dtype=torch.bool)],
        None,
    ]
    arr = encode_json(rows, "col")
    assert json.loads(arr[0].as_py())[TAG] == "dict"
    same_value(rows, decode_json([arr]))


def test_strict_equal():
    assert strict_equal({"a": [1, 2.0]}, {"a": [1, 2.0]})
    assert not strict_equal(0.0, -0.0) and not strict_equal(1, True) and not strict_equal((1,), [1])


def test_unsupported_values_name_the_column_and_row():
    with pytest.raises(TypeError, match=r"column 'c' row 1 holds a builtins.set"):
        encode_pylist([[1], [{1, 2}]], "c")
