"""Dynamic batching plan for one global batch: which rows go to which shard, and micro-batches.

Rows of the global batch are sorted by length (ascending, ties by position) and dealt in
stride: sorted position ``k * shards + s`` becomes row ``k`` of shard ``s``. So row ``k`` of
every shard has a similar length, and one plan serves all shards: micro-batch ``j`` covers rows
``[start_j, end_j)`` of *every* shard (data-parallel ranks stay in lock-step) and is padded to

    padded_j = min(round_up(longest length among those rows on any shard, round_to), width)

where ``width`` is the input tensor's sequence width. Micro-batches are cut greedily so that
``(end_j - start_j) * padded_j <= max_tokens`` (tokens per micro-batch, padding included).
"""

from __future__ import annotations

from typing import Sequence

from nrl_tasks.distributed.sequence_packing import padded_length


def plan_global_batch(
    lengths: Sequence[int],
    offset: int,
    shards: int,
    max_tokens: int,
    round_to: int,
    width: int,
    lengths_key: str = "input_lengths",
) -> tuple[list[list[int]], list[tuple[int, int]], list[int]]:
    """Plan one global batch of ``len(lengths)`` rows (a multiple of ``shards``).

    Args:
        lengths: token count of each row of this global batch.
        offset: index of the global batch's first row in the whole batch (added to row ids).
        shards: data-parallel shard count.
        max_tokens: bound on rows x padded length per micro-batch.
        round_to: padded lengths are rounded up to a multiple of this.
        width: sequence width of the input tensor (padded lengths never exceed it).
        lengths_key: column name, only for error messages.

    Returns:
        ``(rows, ranges, padded)``: ``rows[s]`` the global row ids of shard ``s`` in order;
        ``ranges[j] = (start, end)`` shard-local row range of micro-batch ``j`` (relative to this
        global batch); ``padded[j]`` its padded sequence length.
    """
    if len(lengths) % shards:
        raise ValueError(f"{len(lengths)} rows cannot be split evenly into {shards} shards")
    per_shard = len(lengths) // shards
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    rows = [[offset + order[k * shards + s] for k in range(per_shard)] for s in range(shards)]
    ranges: list[tuple[int, int]] = []
    padded: list[int] = []
    start, current = 0, 0
    for k in range(per_shard):
        longest_row = order[k * shards + shards - 1]  # ascending: the last of the stride is longest
        need = min(padded_length(lengths[longest_row], round_to), width)
        if need > max_tokens:
            raise ValueError(
                f"row {offset + longest_row} has {lengths_key}={lengths[longest_row]} "
                f"(padded to {need} tokens with sequence_length_round={round_to}), more than "
                f"max_tokens_per_microbatch={max_tokens}"
            )
        grown = max(current, need)
        if (k - start + 1) * grown <= max_tokens:
            current = grown
        else:
            ranges.append((start, k))
            padded.append(current)
            start, current = k, need
    if per_shard:
        ranges.append((start, per_shard))
        padded.append(current)
    return rows, ranges, padded


def plan_dynamic_shards(
    lengths: Sequence[int],
    width: int,
    shards: int,
    batch_size: int,
    max_tokens: int,
    round_to: int,
    lengths_key: str = "input_lengths",
) -> tuple[list[list[int]], list[list[tuple[int, int]]], list[list[int]]]:
    """Plan every global batch of ``batch_size`` rows (see ``plan_global_batch``).

    Returns ``(rows, ranges, padded)``: ``rows[s]`` the row ids of shard ``s``, global batch
    after global batch; ``ranges[g]`` and ``padded[g]`` the plan of global batch ``g``, shared by
    all shards. No rows make no global batch (``batch_size`` may then be 0): empty shards, no plan.
    """
    rows: list[list[int]] = [[] for _ in range(shards)]
    ranges, padded = [], []
    if not lengths:
        return rows, ranges, padded
    for off in range(0, len(lengths), batch_size):
        gb_rows, gb_ranges, gb_padded = plan_global_batch(
            lengths[off : off + batch_size], off, shards, max_tokens, round_to, width, lengths_key
        )
        for s in range(shards):
            rows[s] += gb_rows[s]
        ranges.append(gb_ranges)
        padded.append(gb_padded)
    return rows, ranges, padded
