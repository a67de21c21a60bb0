"""Unit tests of BatchedDataDict: every public method and its errors (no sharding plans here)."""

from __future__ import annotations

import pickle

import pytest
import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict, SlicedDataDict


def _batch(n: int = 4) -> BatchedDataDict:
    return BatchedDataDict(
        {
            "ids": torch.arange(n * 3).reshape(n, 3),
            "rewards": torch.arange(n, dtype=torch.float32),
            "text": [f"row{i}" for i in range(n)],
        }
    )


# ---------------------------------------------------------------------------- basics
def test_repr_is_the_plain_dict():
    assert repr(BatchedDataDict({"a": [1, 2], "b": ["x", "y"]})) == "{'a': [1, 2], 'b': ['x', 'y']}"


def test_size_and_get_dict():
    b = _batch(5)
    assert b.size == 5
    assert b.get_dict() is b.data
    assert BatchedDataDict().size == 0


def test_size_mismatch_names_the_columns():
    b = BatchedDataDict({"ids": torch.zeros(3, 2), "text": ["a", "b"]})
    with pytest.raises(ValueError, match=r"'ids': 3.*'text': 2"):
        b.size


def test_bad_column_types():
    with pytest.raises(TypeError, match="'x' holds a tuple"):
        BatchedDataDict({"x": (1, 2)}).size
    with pytest.raises(ValueError, match="'s' is a 0-d tensor"):
        BatchedDataDict({"s": torch.tensor(1.0)}).size


def test_to_moves_tensors_in_place_and_returns_self():
    b = _batch()
    out = b.to("meta")
    assert out is b
    assert b["ids"].device.type == "meta" and b["rewards"].device.type == "meta"
    assert b["text"] == ["row0", "row1", "row2", "row3"]


def test_pickle_round_trip_keeps_type():
    b = SlicedDataDict(_batch().data)
    back = pickle.loads(pickle.dumps(b))
    assert type(back) is SlicedDataDict
    assert torch.equal(back["ids"], b["ids"]) and back["text"] == b["text"]


# ---------------------------------------------------------------------- from_batches
def test_from_batches_concatenates_and_pads():
    a = {"ids": torch.tensor([[1, 2]]), "mask": torch.tensor([[True, True]]),
         "len": torch.tensor([2]), "text": ["a"]}
    b = {"ids": torch.tensor([[3, 4, 5], [6, 7, 8]]), "mask": torch.tensor([[True] * 3] * 2),
         "len": torch.tensor([3, 3]), "text": ["b", "c"]}
    out = BatchedDataDict.from_batches([a, b], pad_value_dict={"ids": -100})
    assert out["ids"].tolist() == [[1, 2, -100], [3, 4, 5], [6, 7, 8]]
    assert out["mask"].dtype == torch.bool and out["mask"][0].tolist() == [True, True, False]
    assert out["len"].tolist() == [2, 3, 3]
    assert out["text"] == ["a", "b", "c"]
    assert list(out) == ["ids", "mask", "len", "text"]
    assert type(out) is BatchedDataDict


def test_from_batches_keeps_dtype_and_pads_3d_on_dim1():
    a = {"logits": torch.ones(1, 2, 4, dtype=torch.bfloat16)}
    b = {"logits": torch.ones(2, 3, 4, dtype=torch.bfloat16)}
    out = SlicedDataDict.from_batches([a, b], pad_value_dict={"logits": 7})
    assert type(out) is SlicedDataDict
    assert out["logits"].shape == (3, 3, 4) and out["logits"].dtype == torch.bfloat16
    assert out["logits"][0, 2].tolist() == [7.0] * 4
    assert out["logits"][1:].eq(1).all()


def test_from_batches_errors():
    with pytest.raises(ValueError, match="at least one batch"):
        BatchedDataDict.from_batches([])
    with pytest.raises(ValueError, match="batch 1 has columns"):
        BatchedDataDict.from_batches([{"a": [1]}, {"b": [1]}])
    with pytest.raises(TypeError, match="column 'a' mixes"):
        BatchedDataDict.from_batches([{"a": [1]}, {"a": torch.tensor([1])}])
    with pytest.raises(ValueError, match="column 'a' has mismatched dtypes"):
        BatchedDataDict.from_batches([{"a": torch.tensor([1])}, {"a": torch.tensor([1.0])}])
    with pytest.raises(ValueError, match="column 'a' has mismatched dtypes or ranks"):
        BatchedDataDict.from_batches([{"a": torch.zeros(1)}, {"a": torch.zeros(1, 2)}])
    with pytest.raises(ValueError, match="column 'a': dims after 1"):
        BatchedDataDict.from_batches([{"a": torch.zeros(1, 2, 3)}, {"a": torch.zeros(1, 2, 4)}])
    with pytest.raises(ValueError, match="different numbers of rows"):
        BatchedDataDict.from_batches([{"a": [1, 2], "b": [1]}])


# ---------------------------------------------------------------- selection / order
def test_select_indices_list_tensor_mask_and_repeats():
    b = _batch()
    assert b.select_indices([3, 0, 3])["text"] == ["row3", "row0", "row3"]
    assert b.select_indices(torch.tensor([1, 2]))["ids"].tolist() == [[3, 4, 5], [6, 7, 8]]
    picked = b.select_indices(torch.tensor([True, False, False, True]))
    assert picked["rewards"].tolist() == [0.0, 3.0]
    assert type(SlicedDataDict(b.data).select_indices([0])) is SlicedDataDict


@pytest.mark.parametrize(
    "bad, match",
    [([4], "index 4 out of range"), ([-1], "index -1 out of range"), ([0.5], "index 0.5"),
     (torch.tensor([0.0]), "1-D integer tensor"), (torch.tensor([True]), "bool mask of shape")],
)
def test_select_indices_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        _batch().select_indices(bad)


def test_reorder_data_inverts_a_permutation():
    b = _batch(5)
    perm = [3, 1, 4, 0, 2]
    shuffled = b.select_indices(perm)
    shuffled.reorder_data(perm)
    assert shuffled["text"] == b["text"]
    assert torch.equal(shuffled["ids"], b["ids"])
    shuffled = b.select_indices(perm)
    shuffled.reorder_data(torch.tensor(perm))
    assert torch.equal(shuffled["rewards"], b["rewards"])


@pytest.mark.parametrize("bad", [[0, 1, 2], [0, 0, 1, 2], [0, 1, 2, 4], [1, 2, 3, 4, 0]])
def test_reorder_data_rejects_non_permutations(bad):
    with pytest.raises(ValueError, match=r"permutation of range\(4\)"):
        _batch().reorder_data(bad)


# ---------------------------------------------------------------------- slicing
def test_slice_returns_views():
    b = _batch()
    s = b.slice(1, 3)
    assert type(s) is SlicedDataDict and s["text"] == ["row1", "row2"]
    s["ids"][0, 0] = -5
    assert b["ids"][1, 0] == -5
    assert b.slice(2, 2).size == 0


@pytest.mark.parametrize("start, end", [(-1, 2), (3, 2), (0, 5)])
def test_slice_errors(start, end):
    with pytest.raises(ValueError, match=rf"slice \[{start}, {end}\) out of range for a batch of 4"):
        _batch().slice(start, end)


def test_chunk_seed_example_and_last_rank():
    b = BatchedDataDict({"x": list("AAABBBDDE"), "t": torch.arange(9)})
    c = b.chunk(2, 3)
    assert type(c) is SlicedDataDict and c["x"] == ["D", "D", "E"] and c["t"].tolist() == [6, 7, 8]
    four = _batch(4)
    assert four.chunk(3, 4)["text"] == ["row3"]  # NeMo-RL rejects this valid call
    piece = four.chunk(0, 2)
    piece["ids"][0, 0] = 99
    assert four["ids"][0, 0] == 0  # a copy, not a view


@pytest.mark.parametrize(
    "rank, chunks, match",
    [(4, 4, "rank 4 out of range for 4 chunks"), (-1, 2, "rank -1 out of range"),
     (0, 0, "chunks must be a positive int"), (0, 3, "4 rows cannot be split into 3")],
)
def test_chunk_errors(rank, chunks, match):
    with pytest.raises(ValueError, match=match):
        _batch(4).chunk(rank, chunks)


def test_get_batch_without_plan():
    b = _batch(6)
    assert b.get_batch(1, 2)["text"] == ["row2", "row3"]
    assert type(b.get_batch(0, 3)) is SlicedDataDict
    with pytest.raises(ValueError, match="needs batch_size"):
        b.get_batch(0)
    with pytest.raises(ValueError, match="global batch 2 of 3 rows ends at row 9, past the 6"):
        b.get_batch(2, 3)
    with pytest.raises(ValueError, match="batch_idx must be a non-negative int"):
        b.get_batch(-1, 2)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        b.get_batch(0, 0)


def test_repeat_interleave_keeps_copies_adjacent_and_independent():
    b = BatchedDataDict({"key": torch.tensor([1, 2, 3]), "msgs": [[{"c": "a"}], [{"c": "b"}], []]})
    r = b.repeat_interleave(2)
    assert r["key"].tolist() == [1, 1, 2, 2, 3, 3]
    assert r["msgs"] == [[{"c": "a"}], [{"c": "a"}], [{"c": "b"}], [{"c": "b"}], [], []]
    r["msgs"][0][0]["c"] = "changed"
    assert r["msgs"][1][0]["c"] == "a" and b["msgs"][0][0]["c"] == "a"
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_repeats must be a positive int"):
            b.repeat_interleave(bad)


def test_truncate_tensors():
    b = BatchedDataDict({"ids": torch.zeros(2, 5), "logits": torch.zeros(2, 5, 3),
                         "short": torch.zeros(2, 2), "len": torch.zeros(2), "text": ["a", "b"]})
    b.truncate_tensors(dim=1, truncated_len=3)
    assert b["ids"].shape == (2, 3) and b["logits"].shape == (2, 3, 3)
    assert b["short"].shape == (2, 2) and b["len"].shape == (2,) and b["text"] == ["a", "b"]
    b.truncate_tensors(dim=2, truncated_len=1)
    assert b["logits"].shape == (2, 3, 1) and b["ids"].shape == (2, 3)
    with pytest.raises(ValueError, match="dim must be an int >= 1"):
        b.truncate_tensors(dim=0, truncated_len=1)
    with pytest.raises(ValueError, match="truncated_len must be a non-negative int"):
        b.truncate_tensors(dim=1, truncated_len=-1)


def test_make_microbatch_iterator():
    mbs = list(_batch(6).make_microbatch_iterator(2))
    assert [m["text"] for m in mbs] == [["row0", "row1"], ["row2", "row3"], ["row4", "row5"]]
    assert all(type(m) is SlicedDataDict for m in mbs)
    with pytest.raises(ValueError, match="6 rows is not a multiple of microbatch_size 4"):
        _batch(6).make_microbatch_iterator(4)
    with pytest.raises(ValueError, match="microbatch_size must be a positive int"):
        _batch(6).make_microbatch_iterator(0)


def test_iterators_without_a_plan_explain_how_to_get_one():
    with pytest.raises(ValueError, match="dynamic_batching_cfg"):
        _batch().make_microbatch_iterator_with_dynamic_shapes()
    with pytest.raises(ValueError, match="sequence_packing_cfg"):
        _batch().get_microbatch_iterator_for_packable_sequences_len()


# ---------------------------------------------------------------- plain sharding
def test_shard_by_batch_size_docstring_example_with_tensors():
    # [A A B B C C D D], batch_size=2, shards=2 -> [A B C D] and [A B C D]
    b = BatchedDataDict({"x": list("AABBCCDD"), "t": torch.arange(8)})
    shards = b.shard_by_batch_size(shards=2, batch_size=2)
    assert [s["x"] for s in shards] == [list("ABCD"), list("ABCD")]
    assert shards[1]["t"].tolist() == [1, 3, 5, 7]
    assert all(type(s) is SlicedDataDict for s in shards)


def test_uneven_shards_may_be_empty():
    shards = BatchedDataDict({"x": [1, 2, 3]}).shard_by_batch_size(4, allow_uneven_shards=True)
    assert [s["x"] for s in shards] == [[1], [2], [3], []]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(shards=0), "shards must be a positive int"),
        (dict(shards=2, batch_size=3), "batch of 8 rows is not a multiple of batch_size 3"),
        (dict(shards=3), "batch_size 8 is not a multiple of shards 3"),
        (dict(shards=2, batch_size=2, allow_uneven_shards=True), "allow_uneven_shards=True"),
        (dict(shards=2, batch_size=0), "batch_size must be a positive int"),
        (dict(shards=2, dynamic_batching_cfg={}, sequence_packing_cfg={}), "not both"),
        (dict(shards=2, allow_uneven_shards=True, dynamic_batching_cfg={}), "dynamic batching"),
    ],
)
def test_shard_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _batch(8).shard_by_batch_size(**kwargs)
