"""Tensor codec pieces: byte-level row concatenation and the Arrow layouts chosen."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from storage.tensor_codec import concat_rows, storage_of, tensor_array, tensor_list_layout
from tests.storage.helpers import ALL_DTYPES, random_tensor, same_value


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_concat_rows_matches_torch_cat_bitwise(dtype):
    parts = [random_tensor((n, 2, 3), dtype, seed=n) for n in (0, 2, 1, 0, 3)]
    expected = torch.cat([p.view(torch.uint8) for p in parts]).view(dtype)
    same_value(expected, concat_rows(parts))
    same_value(torch.empty(0, 4, dtype=dtype), concat_rows([torch.empty(0, 4, dtype=dtype)] * 2))
    same_value(torch.empty(5, 0, dtype=dtype), concat_rows([torch.empty(2, 0, dtype=dtype), torch.empty(3, 0, dtype=dtype)]))


def test_layouts():
    assert tensor_array(torch.arange(3), "k").type == pa.int64()
    assert tensor_array(torch.zeros(2, 3, 4, dtype=torch.bfloat16), "k").type == pa.list_(pa.uint16(), 12)
    assert tensor_array(torch.zeros(2, dtype=torch.complex64), "k").type == pa.list_(pa.float32(), 2)
    assert tensor_array(torch.zeros(2, 0), "k").type == pa.list_(pa.float32(), 0)
    assert storage_of(torch.bool, "k") == (pa.uint8(), 1)
    with pytest.raises(TypeError, match="'q'"):
        storage_of(torch.quint8, "q")
    with pytest.raises(ValueError, match="0-d"):
        tensor_array(torch.tensor(1), "k")
    assert tensor_list_layout([torch.zeros(2, 3), None, torch.zeros(0, 3)]) == (torch.float32, (3,))
    assert tensor_list_layout([torch.zeros(2), torch.zeros(2, dtype=torch.int64)]) is None
    assert tensor_list_layout([torch.zeros(2, 0)]) is None  # first dims would be lost
    assert tensor_list_layout([None, None]) is None and tensor_list_layout([torch.tensor(1.0)]) is None
