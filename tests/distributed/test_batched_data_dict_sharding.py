"""Dynamic batching and sequence packing: examples, errors and hypothesis invariants."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict, SlicedDataDict
from nrl_tasks.distributed.sequence_packing import (
    deal_balanced,
    deal_round_robin,
    equalize_bins,
    first_fit_decreasing,
    modified_first_fit_decreasing,
    padded_length,
    plan_packed_shards,
    split_to_multiple,
)

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
            "logprobs": ids.float().unsqueeze(-1).repeat(1, 1, 2),
            "row": list(range(len(lengths))),
        }
    )


def _dyn(max_tokens: int, round_to: int = 1) -> dict:
    return dict(max_tokens_per_microbatch=max_tokens, sequence_length_round=round_to,
                input_key="input_ids", input_lengths_key="input_lengths")


def _pack(capacity: int, algorithm: str = "first_fit_decreasing", multiple: int = 1) -> dict:
    return dict(max_tokens_per_microbatch=capacity, input_key="input_ids",
                input_lengths_key="input_lengths", algorithm=algorithm,
                sequence_length_pad_multiple=multiple)


def _restored(shards: list, indices: list[int]) -> BatchedDataDict:
    merged = BatchedDataDict.from_batches(shards)
    merged.reorder_data(indices)
    return merged


# ------------------------------------------------------------------ dynamic batching
def test_dynamic_batching_hand_computed_plan():
    lengths = [5, 1, 7, 3, 2, 8, 4, 6]
    shards, indices = _rollouts(lengths).shard_by_batch_size(2, dynamic_batching_cfg=_dyn(16, 2))
    # sorted ascending, strided: shard 0 gets lengths 1 3 5 7, shard 1 gets 2 4 6 8
    assert [s["row"] for s in shards] == [[1, 3, 0, 2], [4, 6, 7, 5]]
    assert indices == [1, 3, 0, 2, 4, 6, 7, 5]
    for s in shards:
        assert s.micro_batch_kind == "dynamic"
        assert s.micro_batch_indices == [[(0, 2), (2, 4)]]  # 2 rows x 4, then 2 rows x 8 tokens
        assert s.micro_batch_lengths == [[4, 8]]
        assert s.elem_counts_per_gb == [4]
        assert s.get_microbatch_iterator_dynamic_shapes_len() == 2
    mbs = list(shards[1].make_microbatch_iterator_with_dynamic_shapes())
    assert [tuple(m["input_ids"].shape) for m in mbs] == [(2, 4), (2, 8)]
    assert mbs[0]["logprobs"].shape == (2, 4, 2) and mbs[0]["row"] == [4, 6]
    assert all(type(m) is SlicedDataDict for m in mbs)


def test_dynamic_batching_restores_order_with_batch_size():
    """NeMo-RL's indices are wrong when batch_size splits the batch: ours restore it."""
    lengths = [9, 3, 5, 1, 8, 2, 7, 4, 6, 10, 11, 12]
    batch = _rollouts(lengths)
    shards, indices = batch.shard_by_batch_size(2, batch_size=6, dynamic_batching_cfg=_dyn(24))
    restored = _restored(shards, indices)
    assert restored["row"] == list(range(12))
    assert torch.equal(restored["input_ids"], batch["input_ids"])
    # global batch 0 (rows 0-5) comes first on every shard, then global batch 1
    assert all(max(s["row"][:3]) < 6 <= min(s["row"][3:]) for s in shards)
    assert shards[0].elem_counts_per_gb == [3, 3] and len(shards[0].micro_batch_indices) == 2


def test_dynamic_batching_get_batch_keeps_its_plan():
    shards, _ = _rollouts(list(range(1, 17))).shard_by_batch_size(
        2, batch_size=8, dynamic_batching_cfg=_dyn(32, 4))
    whole = shards[0]
    gb1 = whole.get_batch(1)
    assert gb1["row"] == whole["row"][4:] and gb1.micro_batch_indices == [whole.micro_batch_indices[1]]
    assert whole.get_batch(1, 4).micro_batch_lengths == [whole.micro_batch_lengths[1]]
    all_mbs = [m["row"] for m in whole.make_microbatch_iterator_with_dynamic_shapes()]
    per_gb = [m["row"] for g in range(2) for m in whole.get_batch(g).make_microbatch_iterator_with_dynamic_shapes()]
    assert all_mbs == per_gb
    with pytest.raises(ValueError, match="batch_size 3 disagrees with the dynamic-batching plan"):
        whole.get_batch(0, 3)
    with pytest.raises(ValueError, match="batch_idx 2 out of range: the plan has 2"):
        whole.get_batch(2)


def test_plan_survives_pickle_and_to_but_not_reorder():
    shards, _ = _rollouts([3, 1, 2, 4]).shard_by_batch_size(2, dynamic_batching_cfg=_dyn(8))
    back = pickle.loads(pickle.dumps(shards[0]))  # what Ray transport does
    assert back.micro_batch_indices == shards[0].micro_batch_indices
    assert back.to("cpu").get_microbatch_iterator_dynamic_shapes_len() == 1
    back.reorder_data([1, 0])
    assert back.micro_batch_kind is None


def test_plan_detects_rows_changed_after_sharding():
    shards, _ = _rollouts([3, 1, 2, 4]).shard_by_batch_size(2, dynamic_batching_cfg=_dyn(8))
    shards[0]["extra"] = [1, 2, 3]
    with pytest.raises(ValueError, match="different numbers of rows"):
        shards[0].get_microbatch_iterator_dynamic_shapes_len()
    shards[1].data = {k: v[:1] for k, v in shards[1].data.items()}
    with pytest.raises(ValueError, match="plan covers 2 rows but the batch has 1"):
        shards[1].get_microbatch_iterator_dynamic_shapes_len()


def test_dynamic_batching_errors():
    b = _rollouts([3, 9, 2, 4], width=10)
    with pytest.raises(ValueError, match=r"row 1 has input_lengths=9 \(padded to 10 tokens.*max_tokens_per_microbatch=8"):
        b.shard_by_batch_size(2, dynamic_batching_cfg=_dyn(8, 4))
    with pytest.raises(ValueError, match=r"DynamicBatchingCfg is missing \['sequence_length_round'\]"):
        b.shard_by_batch_size(2, dynamic_batching_cfg={k: v for k, v in _dyn(8).items()
                                                        if k != "sequence_length_round"})
    with pytest.raises(ValueError, match="column 'nope' named in DynamicBatchingCfg"):
        b.shard_by_batch_size(2, dynamic_batching_cfg={**_dyn(8), "input_key": "nope"})
    with pytest.raises(ValueError, match="column 'row' must be a \\[B, S\\] tensor"):
        b.shard_by_batch_size(2, dynamic_batching_cfg={**_dyn(8), "input_key": "row"})
    b["input_lengths"] = torch.tensor([3, 11, 2, 4])
    with pytest.raises(ValueError, match=r"row 1: input_lengths=11 is not an int in \[0, 10\]"):
        b.shard_by_batch_size(2, dynamic_batching_cfg=_dyn(64))
    with pytest.raises(ValueError, match="max_tokens_per_microbatch must be a positive int"):
        _rollouts([1, 2]).shard_by_batch_size(2, dynamic_batching_cfg=_dyn(0))
    with pytest.raises(ValueError, match="batch_size 4 is not a multiple of shards 3"):
        _rollouts([1, 2, 3, 4]).shard_by_batch_size(3, dynamic_batching_cfg=_dyn(8))


def test_wrong_iterator_for_the_plan():
    shards, _ = _rollouts([3, 1, 2, 4]).shard_by_batch_size(2, sequence_packing_cfg=_pack(8))
    with pytest.raises(ValueError, match="no 'dynamic' micro-batch plan \\(it has 'packing'\\)"):
        list(shards[0].make_microbatch_iterator_with_dynamic_shapes())


# ------------------------------------------------------------------- packing algorithms
def _naive_first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b in range(len(bins)):
            if room[b] >= lengths[i]:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def test_ffd_hand_example():
    assert first_fit_decreasing([4, 1, 3, 2, 1, 3, 4, 5], 5) == [[7], [0, 1], [6, 4], [2, 3], [5]]


def test_mffd_hand_example():
    # C=12: large 8, 7; medium 6, 5; small 4, 3; tiny 2, 1
    bins = modified_first_fit_decreasing([8, 7, 6, 5, 4, 3, 2, 1], 12)
    assert bins == [[0, 4], [1, 3], [2, 5, 6, 7]]


@pytest.mark.parametrize("packer", [first_fit_decreasing, modified_first_fit_decreasing])
def test_packers_reject_rows_over_capacity(packer):
    with pytest.raises(ValueError, match="row 1 needs 9 tokens .* capacity of 8"):
        packer([3, 9], 8)


def test_split_to_multiple_and_dealing():
    assert split_to_multiple([[0, 1, 2]], [5, 1, 3], 2) == [[1, 2], [0]]
    assert split_to_multiple([[0, 1]], [1, 1], 4) == [[1], [0], [], []]  # too few rows: empty bins
    tokens = [10, 9, 8, 7, 2, 1]
    assert [sum(tokens[b] for b in s) for s in deal_round_robin(tokens, 2)] == [20, 17]
    balanced = deal_balanced(tokens, 2)
    assert sorted(sum(tokens[b] for b in s) for s in balanced) == [18, 19]
    assert all(len(s) == 3 for s in balanced)


def test_equalize_bins():
    # FFD: [2000, 2000] and fourteen 100s -> bins of 4000 and 1400 tokens
    lengths = [2000, 2000] + [100] * 14
    ffd = first_fit_decreasing(lengths, 4096)
    assert [sum(lengths[i] for i in b) for b in ffd] == [4000, 1400]
    even = equalize_bins(ffd, lengths, 4096)
    assert [sum(lengths[i] for i in b) for b in even] == [2700, 2700]
    assert equalize_bins([[0], [1, 2]], [5, 3, 3], 5) == [[0], [1, 2]]  # 6 > 5: kept as given


def test_packing_balances_tokens_where_round_robin_does_not():
    """NeMo-RL deals bins round-robin: here one rank gets 4000 tokens, the other 1400."""
    lengths = [2000, 2000] + [100] * 14
    shards, _ = _rollouts(lengths).shard_by_batch_size(2, sequence_packing_cfg=_pack(4096))
    assert [sum(s.micro_batch_lengths[0]) for s in shards] == [2700, 2700]
    _, robin = plan_packed_shards(lengths, 2, 16, 4096, "first_fit_decreasing",
                                  balance=False, equalize=False)
    assert [sum(p[1][0]) for p in robin] == [4000, 1400]


# --------------------------------------------------------------- sequence packing shards
def test_sequence_packing_shards_and_iterator():
    lengths = [7, 2, 5, 3, 6, 1, 4, 8, 3, 5]
    batch = _rollouts(lengths)
    shards, indices = batch.shard_by_batch_size(2, sequence_packing_cfg=_pack(10, multiple=2))
    assert _restored(shards, indices)["row"] == list(range(10))
    counts = [s.get_microbatch_iterator_for_packable_sequences_len() for s in shards]
    assert counts[0][0] == counts[1][0]
    for s in shards:
        assert s.micro_batch_kind == "packing" and s.elem_counts_per_gb == [s.size]
        bins = list(s.make_microbatch_iterator_for_packable_sequences())
        assert [b["row"] for b in bins] == [s["row"][a:e] for a, e in s.micro_batch_indices[0]]
        for b, tokens in zip(bins, s.micro_batch_lengths[0]):
            assert 0 < b.size and tokens == sum(padded_length(lengths[r], 2) for r in b["row"]) <= 10
            assert type(b) is SlicedDataDict
    loads = [sum(s.micro_batch_lengths[0]) for s in shards]
    assert max(loads) - min(loads) <= 2


def test_sequence_packing_pads_with_empty_bins_when_rows_are_too_few():
    # every row fills a bin: 3 bins for 2 shards -> 4 bins, one empty
    batch = _rollouts([4, 4, 4])
    shards, indices = batch.shard_by_batch_size(2, sequence_packing_cfg=_pack(4))
    assert _restored(shards, indices)["row"] == [0, 1, 2]
    assert [s.get_microbatch_iterator_for_packable_sequences_len() for s in shards] == [(2, 4), (2, 4)]
    sizes = sorted(b.size for s in shards for b in s.make_microbatch_iterator_for_packable_sequences())
    assert sizes == [0, 1, 1, 1]
    empty = [b for s in shards for b in s.make_microbatch_iterator_for_packable_sequences() if b.size == 0]
    assert empty[0]["input_ids"].shape == (0, 4) and empty[0]["row"] == []
    # fewer rows than shards
    shards, _ = _rollouts([2, 3]).shard_by_batch_size(3, sequence_packing_cfg=_pack(8))
    assert sorted(s.size for s in shards) == [0, 1, 1]
    assert {s.get_microbatch_iterator_for_packable_sequences_len()[0] for s in shards} == {1}


def test_sequence_packing_errors():
    b = _rollouts([3, 9, 2, 4], width=10)
    with pytest.raises(ValueError, match=r"row 1 has input_lengths=9 \(padded to 12 with sequence_length_pad_multiple=4\)"):
        b.shard_by_batch_size(2, sequence_packing_cfg=_pack(10, multiple=4))
    with pytest.raises(ValueError, match="unknown sequence packing algorithm 'best_fit'"):
        b.shard_by_batch_size(2, sequence_packing_cfg=_pack(10, algorithm="best_fit"))
    with pytest.raises(ValueError, match="SequencePackingCfg is missing \\['algorithm'\\]"):
        b.shard_by_batch_size(2, sequence_packing_cfg={k: v for k, v in _pack(10).items() if k != "algorithm"})


# ----------------------------------------------------------------- hypothesis invariants
@st.composite
def _batches(draw, max_len: int = 40):
    shards = draw(st.integers(1, 4))
    per_gb = shards * draw(st.integers(1, 5))
    num_gb = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(0, max_len), min_size=per_gb * num_gb, max_size=per_gb * num_gb))
    width = draw(st.integers(max(lengths), max_len + 8))
    return lengths, width, shards, per_gb if num_gb > 1 or draw(st.booleans()) else None


@settings(max_examples=150, deadline=None)
@given(data=_batches(), round_to=st.sampled_from([1, 4, 16]), slack=st.integers(0, 200))
def test_dynamic_batching_invariants(data, round_to, slack):
    lengths, width, shards, batch_size = data
    max_tokens = min(padded_length(max(lengths), round_to), width) + slack
    if max_tokens == 0:
        max_tokens = 1
    batch = _rollouts(lengths, width)
    out, indices = batch.shard_by_batch_size(shards, batch_size, dynamic_batching_cfg=_dyn(max_tokens, round_to))
    assert sorted(indices) == list(range(len(lengths)))  # nothing lost or duplicated
    restored = _restored(out, indices)
    assert restored["row"] == list(range(len(lengths)))
    assert torch.equal(restored["input_ids"], batch["input_ids"])
    counts = {s.get_microbatch_iterator_dynamic_shapes_len() for s in out}
    assert len(counts) == 1  # lock-step
    for s in out:
        for mb in s.make_microbatch_iterator_with_dynamic_shapes():
            rows, seq = mb["input_ids"].shape
            assert rows * seq <= max_tokens and seq <= width
            assert all(lengths[r] <= seq for r in mb["row"])  # truncation never cuts tokens
            assert mb["input_ids"].count_nonzero() == sum(lengths[r] for r in mb["row"])


@settings(max_examples=150, deadline=None)
@given(data=_batches(), algorithm=st.sampled_from(ALGORITHMS), multiple=st.sampled_from([1, 8]),
       slack=st.integers(0, 100))
def test_sequence_packing_invariants(data, algorithm, multiple, slack):
    lengths, width, shards, batch_size = data
    capacity = max(1, padded_length(max(lengths), multiple) + slack)
    batch = _rollouts(lengths, width)
    out, indices = batch.shard_by_batch_size(shards, batch_size, sequence_packing_cfg=_pack(capacity, algorithm, multiple))
    assert sorted(indices) == list(range(len(lengths)))
    assert _restored(out, indices)["row"] == list(range(len(lengths)))
    num_gb = len(out[0].elem_counts_per_gb)
    gb_rows = batch_size or len(lengths)
    for g in range(num_gb):
        assert len({len(s.micro_batch_indices[g]) for s in out}) == 1  # same bins per shard
        bins = [e - a for s in out for a, e in s.micro_batch_indices[g]]
        assert all(bins) or gb_rows < len(bins)  # empty bins only when rows are too few
    _, robin = plan_packed_shards(lengths, shards, batch_size or len(lengths), capacity, algorithm,
                                  multiple, balance=False, equalize=False)
    for g in range(num_gb):  # the heaviest shard never carries more than under round-robin
        assert max(sum(s.micro_batch_lengths[g]) for s in out) <= max(sum(p[1][g]) for p in robin)
    for s in out:
        for bin_rows, tokens in zip(s.make_microbatch_iterator_for_packable_sequences(),
                                    [t for gb in s.micro_batch_lengths for t in gb]):
            assert tokens == sum(padded_length(lengths[r], multiple) for r in bin_rows["row"]) <= capacity


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 50), min_size=1, max_size=60), slack=st.integers(0, 60),
       shards=st.integers(1, 8))
def test_packing_and_dealing_vs_references(lengths, slack, shards):
    capacity = max(1, max(lengths) + slack)
    assert first_fit_decreasing(lengths, capacity) == _naive_first_fit(lengths, capacity)
    for bins in (first_fit_decreasing(lengths, capacity), modified_first_fit_decreasing(lengths, capacity)):
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
        if len(lengths) < shards:
            continue
        bins = split_to_multiple(bins, lengths, shards)
        assert len(bins) % shards == 0
        assert all(bins) or len(lengths) < len(bins)  # empty bins only when rows are too few
        even = equalize_bins(bins, lengths, capacity)
        assert len(even) == len(bins) and (all(even) or len(lengths) < len(bins))
        assert sorted(i for b in even for i in b) == list(range(len(lengths)))
        loads = [sum(lengths[i] for i in b) for b in even]
        assert max(loads) <= capacity
        if even != bins:  # worst-fit decreasing: spread at most one row
            assert max(loads) - min(loads) <= max(lengths)
        tokens = [sum(lengths[i] for i in b) for b in bins]
        balanced = [sum(tokens[b] for b in s) for s in deal_balanced(tokens, shards)]
        robin = [sum(tokens[b] for b in s) for s in deal_round_robin(tokens, shards)]
        assert max(balanced) <= max(robin)
        assert sum(balanced) == sum(robin) == sum(lengths)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 30), shards=st.integers(1, 5), gb=st.integers(1, 3))
def test_plain_sharding_partitions_rows(n, shards, gb):
    total = n * shards * gb
    batch = BatchedDataDict({"row": list(range(total)), "t": torch.arange(total)})
    out = batch.shard_by_batch_size(shards, batch_size=n * shards if n else None)
    assert sorted(r for s in out for r in s["row"]) == list(range(total))
    for s_idx, s in enumerate(out):
        assert s["t"].tolist() == s["row"]
        # shard s holds piece s of every global batch, in global-batch order
        assert s["row"] == sorted(s["row"])
        assert all((r % (n * shards)) // n == s_idx for r in s["row"]) if n else s.size == 0
