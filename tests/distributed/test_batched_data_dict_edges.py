"""BatchedDataDict edges: 0-row batches with micro-batch plans, index types, cfg keys, and
``from_batches`` over the union of columns; hypothesis properties for sharding and round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict, SlicedDataDict
from nrl_tasks.distributed.microbatch_plan import check_cfg
from nrl_tasks.distributed.sequence_packing import padded_length
from tests.distributed.test_batched_data_dict_sharding import _dyn, _pack, _restored  # the sharding tests' cfg helpers

ALGORITHMS = ["first_fit_decreasing", "modified_first_fit_decreasing"]


def _rollouts(lengths: list[int], width: int | None = None) -> BatchedDataDict:
    """Rows whose input ids are ``row index + 1`` over their length, 0 after (right padding)."""
    width = max(lengths, default=1) if width is None else width
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = i + 1
    return BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": torch.tensor(lengths, dtype=torch.int32),
            "row": list(range(len(lengths))),
        }
    )


def _cfg_kwarg(kind: str, cfg: dict) -> dict:
    return {"dynamic_batching_cfg" if kind == "dynamic" else "sequence_packing_cfg": cfg}


# ------------------------------------------------------------ 1. 0-row batches with a plan
@pytest.mark.parametrize("kind, cfg", [("dynamic", _dyn(8)), ("packing", _pack(8))])
@pytest.mark.parametrize("shards, batch_size", [(1, None), (3, None), (2, 4), (4, 4)])
def test_zero_rows_give_empty_shards_and_empty_plans(kind, cfg, shards, batch_size):
    batch = _rollouts([])
    plain = batch.shard_by_batch_size(shards, batch_size)
    out, indices = batch.shard_by_batch_size(shards, batch_size, **_cfg_kwarg(kind, cfg))
    assert indices == [] and len(out) == len(plain) == shards
    for shard, plain_shard in zip(out, plain):
        assert type(shard) is SlicedDataDict and shard.size == 0
        assert list(shard) == list(plain_shard)
        assert shard["input_ids"].shape == plain_shard["input_ids"].shape == (0, 1)
        assert shard.micro_batch_kind == kind
        assert shard.micro_batch_indices == shard.micro_batch_lengths == []
        assert shard.elem_counts_per_gb == []
        if kind == "dynamic":
            assert shard.get_microbatch_iterator_dynamic_shapes_len() == 0
            assert list(shard.make_microbatch_iterator_with_dynamic_shapes()) == []
        else:
            assert shard.get_microbatch_iterator_for_packable_sequences_len() == (0, 0)
            assert list(shard.make_microbatch_iterator_for_packable_sequences()) == []
    assert _restored(out, indices).size == 0


@pytest.mark.parametrize("kind, cfg", [("dynamic", _dyn(8)), ("packing", _pack(8))])
def test_batch_without_columns_shards_with_a_plan(kind, cfg):
    out, indices = BatchedDataDict().shard_by_batch_size(2, **_cfg_kwarg(kind, cfg))
    assert indices == [] and [dict(s) for s in out] == [{}, {}]
    assert all(s.micro_batch_kind == kind and s.elem_counts_per_gb == [] for s in out)


@pytest.mark.parametrize("kind, cfg", [("dynamic", _dyn(8)), ("packing", _pack(8))])
def test_zero_rows_still_check_the_cfg(kind, cfg):
    with pytest.raises(ValueError, match="column 'nope' named in"):
        _rollouts([]).shard_by_batch_size(2, **_cfg_kwarg(kind, {**cfg, "input_key": "nope"}))
    with pytest.raises(ValueError, match="unknown keys \\['max_tokens'\\]"):
        _rollouts([]).shard_by_batch_size(2, **_cfg_kwarg(kind, {**cfg, "max_tokens": 8}))


# ------------------------------------------------------------- 2. select_indices inputs
@pytest.mark.parametrize(
    "indices, rows",
    [
        ([2, 0], [2, 0]),
        ((2, 0), [2, 0]),
        (range(2, -1, -2), [2, 0]),
        (np.array([2, 0]), [2, 0]),
        (np.array([2, 0], dtype=np.int8), [2, 0]),
        (np.array([2, 0], dtype=np.uint32), [2, 0]),
        (np.array([], dtype=np.int64), []),
        ([np.int64(2), np.int32(0)], [2, 0]),
        (torch.tensor([2, 0]), [2, 0]),
        (torch.tensor([2, 0], dtype=torch.int32), [2, 0]),
        (torch.tensor([2, 0], dtype=torch.uint8), [2, 0]),
        (np.int64(1), [1]),  # a scalar selects one row and keeps the batch dim
        (np.array(1), [1]),
        (torch.tensor(1), [1]),
        (1, [1]),
    ],
    ids=["list", "tuple", "range", "np-int64", "np-int8", "np-uint32", "np-empty", "np-ints",
         "torch-int64", "torch-int32", "torch-uint8", "np-scalar", "np-0d", "torch-0d", "int"],
)
def test_select_indices_accepts_int_like_indices(indices, rows):
    b = BatchedDataDict({"t": torch.arange(3) * 10, "ids": torch.arange(6).reshape(3, 2),
                         "x": list("abc")})
    picked = b.select_indices(indices)
    assert picked["x"] == [list("abc")[r] for r in rows]
    assert picked["t"].tolist() == [10 * r for r in rows]
    assert picked["ids"].shape == (len(rows), 2)


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.array([1.0, 0.0]), "integer numpy array, got dtype float64"),
        (np.array([True, False, True]), "got dtype bool .*np.flatnonzero"),
        (np.array([[0, 1]]), r"got dtype int64 of shape \(1, 2\)"),
        (np.array(["0"]), "got dtype <U1"),
        (torch.tensor([1.0]), "integer tensor, got torch.float32"),
        (torch.tensor([[0]]), r"integer tensor, got torch.int64 of shape \(1, 1\)"),
        (np.float64(1.0), "got float64"),
        (1.0, "got float"),
        (True, "got bool"),
        ([np.True_], "is a bool"),
        ([torch.tensor(True)], "is a bool"),
        ([1, 2.5], "index 2.5 is not an integer"),
        ({0, 1}, "got set"),
        ("01", "got str"),
        (np.array([0, 3]), "index 3 out of range for a batch of 3 rows"),
        (np.array([-1]), "index -1 out of range"),
    ],
    ids=lambda v: repr(v)[:40],
)
def test_select_indices_refuses_non_integer_indices(bad, match):
    with pytest.raises(ValueError, match=match):
        BatchedDataDict({"x": list("abc")}).select_indices(bad)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 8), data=st.data())
def test_select_indices_forms_agree(size, data):
    rows = data.draw(st.lists(st.integers(0, size - 1), max_size=10))
    b = BatchedDataDict({"x": list(range(size)), "t": torch.arange(size)})
    forms = [rows, tuple(rows), np.array(rows, dtype=np.int64), np.array(rows, dtype=np.int16),
             torch.tensor(rows, dtype=torch.long), [np.int64(r) for r in rows]]
    for form in forms:
        picked = b.select_indices(form)
        assert picked["x"] == rows and picked["t"].tolist() == rows


# --------------------------------------------------------------------- 3. cfg keys
def test_unknown_cfg_key_is_refused_with_the_allowed_keys():
    b = _rollouts([3, 1, 2, 4])
    with pytest.raises(ValueError, match=(
        r"DynamicBatchingCfg has unknown keys \['max_tokens_per_micro_batch'\] \(did you mean "
        r"'max_tokens_per_microbatch' for 'max_tokens_per_micro_batch'\?\); allowed keys: "
        r"\['max_tokens_per_microbatch', 'sequence_length_round', 'input_key', "
        r"'input_lengths_key'\]")):
        b.shard_by_batch_size(2, dynamic_batching_cfg={**_dyn(8), "max_tokens_per_micro_batch": 4})
    # a dynamic-batching key in a packing cfg is a typical slip
    with pytest.raises(ValueError,
                       match=r"SequencePackingCfg has unknown keys \['sequence_length_round'\]"):
        b.shard_by_batch_size(2, sequence_packing_cfg={**_pack(8), "sequence_length_round": 4})


def test_renamed_cfg_key_reports_unknown_and_missing_in_one_error():
    cfg = {k: v for k, v in _pack(8).items() if k != "sequence_length_pad_multiple"}
    cfg["sequence_length_pad_multple"] = 4
    with pytest.raises(ValueError) as err:
        _rollouts([3, 1]).shard_by_batch_size(1, sequence_packing_cfg=cfg)
    msg = str(err.value)
    assert "unknown keys ['sequence_length_pad_multple']" in msg
    assert "did you mean 'sequence_length_pad_multiple'" in msg
    assert "SequencePackingCfg is missing ['sequence_length_pad_multiple']" in msg


def test_missing_cfg_keys_are_all_named():
    with pytest.raises(ValueError, match=(
            r"DynamicBatchingCfg is missing \['max_tokens_per_microbatch', "
            r"'sequence_length_round', 'input_lengths_key'\]")):
        _rollouts([1, 2]).shard_by_batch_size(2, dynamic_batching_cfg={"input_key": "input_ids"})


def test_cfg_is_checked_before_the_data():
    """A bad cfg is reported whatever the batch, even one that could not be sharded anyway."""
    with pytest.raises(ValueError, match="unknown keys \\['algorithm'\\]"):
        _rollouts([1, 2, 3]).shard_by_batch_size(2, batch_size=2,
                                                 dynamic_batching_cfg={**_dyn(8), "algorithm": "x"})


def test_check_cfg_lists_every_problem():
    cfg = {**_pack(0, algorithm="best_fit"), "sequence_length_pad_multiple": True, "extra": 1}
    with pytest.raises(ValueError) as err:
        check_cfg(cfg, "packing")
    msg = str(err.value)
    for part in ("unknown keys ['extra']",
                 "max_tokens_per_microbatch must be a positive int, got 0",
                 "sequence_length_pad_multiple must be a positive int, got True",
                 "unknown sequence packing algorithm 'best_fit'"):
        assert part in msg
    with pytest.raises(TypeError, match="DynamicBatchingCfg must be a dict, got list"):
        check_cfg([("input_key", "input_ids")], "dynamic")
    check_cfg(_dyn(8), "dynamic")
    check_cfg(_pack(8), "packing")


# ----------------------------------------------------- 4. from_batches: union of columns
def test_from_batches_takes_the_union_and_skips_empty_batches_lacking_columns():
    out = BatchedDataDict.from_batches(
        [{"a": [1], "ids": torch.tensor([[1, 2]])},
         {},
         {"a": []},
         {"a": [2], "ids": torch.tensor([[3]])}],
        pad_value_dict={"ids": -1},
    )
    assert out["a"] == [1, 2] and out["ids"].tolist() == [[1, 2], [3, -1]]


def test_from_batches_of_empty_batches_with_different_columns():
    out = BatchedDataDict.from_batches([{"a": []}, {"b": torch.zeros(0, 3)}, BatchedDataDict()])
    assert list(out) == ["a", "b"] and out.size == 0 and out["b"].shape == (0, 3)


def test_from_batches_keeps_first_seen_column_order():
    out = BatchedDataDict.from_batches([{}, {"b": [1], "a": [2]}, {"a": [3], "b": [4]}])
    assert list(out) == ["b", "a"] and out["a"] == [2, 3]


def test_from_batches_non_empty_batch_lacking_a_column_names_it():
    with pytest.raises(ValueError, match=r"batch 0 has columns \['a'\] but lacks \['b'\] "
                                         r"\(only a 0-row batch may omit columns\)"):
        BatchedDataDict.from_batches([{"a": [1]}, {"a": [], "b": []}])
    with pytest.raises(ValueError, match=r"batch 1 has columns \['a'\] but lacks \['b'\]; "
                                         r"batch 3 has columns \['b'\] but lacks \['a'\]"):
        BatchedDataDict.from_batches([{"a": [1], "b": [1]}, {"a": [2]}, {}, {"b": [3]}])


def test_from_batches_checks_row_counts_within_each_batch():
    """Two ragged batches used to merge silently into equal-length columns."""
    with pytest.raises(ValueError, match="batch 0: columns have different numbers of rows"):
        BatchedDataDict.from_batches([{"a": [1, 2], "b": [1]}, {"a": [3], "b": [2, 3]}])


# ------------------------------------------------------------- hypothesis properties
@st.composite
def _shard_cases(draw):
    """(mode, lengths, width, shards, batch_size) valid for that mode, row counts including 0."""
    mode = draw(st.sampled_from(["plain", "uneven", "dynamic", "packing"]))
    shards = draw(st.integers(1, 4))
    if mode in ("plain", "dynamic"):
        per_gb = shards * draw(st.integers(0, 4))
    else:
        per_gb = draw(st.integers(0, 9))
    num_gb = draw(st.integers(1, 3)) if per_gb and mode != "uneven" else 1
    lengths = draw(st.lists(st.integers(0, 12), min_size=per_gb * num_gb, max_size=per_gb * num_gb))
    width = draw(st.integers(max(lengths, default=1), 16))
    explicit = per_gb and mode != "uneven" and (num_gb > 1 or draw(st.booleans()))
    return mode, lengths, width, shards, per_gb if explicit else None


def _split(values: list, counts: list[int]) -> list[list]:
    out, start = [], 0
    for n in counts:
        out.append(values[start : start + n])
        start += n
    return out


@settings(max_examples=200, deadline=None)
@given(case=_shard_cases(), slack=st.integers(0, 30), round_to=st.sampled_from([1, 4]),
       algorithm=st.sampled_from(ALGORITHMS))
def test_sharding_holds_every_row_exactly_once(case, slack, round_to, algorithm):
    mode, lengths, width, shards, batch_size = case
    n = len(lengths)
    gb_rows = batch_size or n
    batch = _rollouts(lengths, width)
    if mode in ("plain", "uneven"):
        out = batch.shard_by_batch_size(shards, batch_size, allow_uneven_shards=mode == "uneven")
        assert len(out) == shards and all(type(s) is SlicedDataDict for s in out)
        assert sorted(r for s in out for r in s["row"]) == list(range(n))
        # documented order: shard s holds piece s of every global batch, pieces in row order
        num_gb = n // gb_rows if gb_rows else 0
        per_shard = [_split(s["row"], [len(s["row"]) // max(num_gb, 1)] * num_gb) for s in out]
        for g in range(num_gb):
            in_shard_order = [r for pieces in per_shard for r in pieces[g]]
            assert in_shard_order == list(range(g * gb_rows, (g + 1) * gb_rows))
        for s in out:
            assert torch.equal(s["input_ids"], batch["input_ids"][s["row"]])
        return
    if mode == "dynamic":
        longest = min(padded_length(max(lengths, default=0), round_to), width)
        cfg = {"dynamic_batching_cfg": _dyn(max(1, longest) + slack, round_to)}
    else:
        cfg = {"sequence_packing_cfg": _pack(max(1, max(lengths, default=0)) + slack, algorithm)}
    out, indices = batch.shard_by_batch_size(shards, batch_size, **cfg)
    assert len(out) == shards and all(type(s) is SlicedDataDict for s in out)
    # indices[p] is the original row at position p of the shards' concatenation
    assert [r for s in out for r in s["row"]] == indices
    assert sorted(indices) == list(range(n))
    restored = _restored(out, indices)
    assert restored["row"] == list(range(n))
    assert torch.equal(restored["input_ids"], batch["input_ids"])
    num_gb = n // gb_rows if gb_rows else 0
    iterate = ("make_microbatch_iterator_with_dynamic_shapes" if mode == "dynamic"
               else "make_microbatch_iterator_for_packable_sequences")
    for s in out:
        assert len(s.elem_counts_per_gb) == len(s.micro_batch_indices) == num_gb
        assert sum(s.elem_counts_per_gb) == s.size
        for g, rows in enumerate(_split(s["row"], s.elem_counts_per_gb)):
            assert all(g * gb_rows <= r < (g + 1) * gb_rows for r in rows)  # global batches kept
        assert [r for mb in getattr(s, iterate)() for r in mb["row"]] == s["row"]
    for g in range(num_gb):
        assert len({len(s.micro_batch_indices[g]) for s in out}) == 1  # lock-step


_PAD = {"ids": -1, "lp": 0.0}


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), max_size=12),
       cuts=st.lists(st.integers(0, 12), max_size=6), data=st.data())
def test_from_batches_of_random_splits_round_trips(lengths, cuts, data):
    n = len(lengths)
    width = max(lengths, default=0)
    ids = torch.full((n, width), -1, dtype=torch.long)
    lp = torch.zeros(n, width, 2)
    for i, length in enumerate(lengths):
        ids[i, :length] = i + 1
        lp[i, :length] = float(i + 1)
    whole = {"ids": ids, "lp": lp, "lengths": torch.tensor(lengths, dtype=torch.long),
             "row": list(range(n))}
    bounds = [0, *sorted(min(c, n) for c in cuts), n]
    pieces = []
    for start, end in zip(bounds, bounds[1:]):
        piece_width = max(lengths[start:end], default=0)  # each piece only as wide as it needs
        piece = {k: v[start:end, :piece_width] if k in _PAD else v[start:end]
                 for k, v in whole.items()}
        if end == start:  # an empty batch may lack any columns
            keep = data.draw(st.lists(st.sampled_from(list(whole)), unique=True))
            piece = {k: piece[k] for k in keep}
        pieces.append(BatchedDataDict(piece) if data.draw(st.booleans()) else piece)
    out = BatchedDataDict.from_batches(pieces, pad_value_dict=_PAD)
    expected_keys = list(dict.fromkeys(k for p in pieces for k in p))
    assert list(out) == expected_keys
    if n:
        assert sorted(expected_keys) == sorted(whole)
    for k in expected_keys:
        if isinstance(whole[k], list):
            assert out[k] == whole[k]
        else:
            assert out[k].dtype == whole[k].dtype and torch.equal(out[k], whole[k]), k
