"""Micro-batch plan settings and the cfg-checked planner behind ``shard_by_batch_size``.

``DynamicBatchingCfg`` and ``SequencePackingCfg`` are the two plan kinds' settings (units:
tokens). ``plan_shards`` checks a cfg against a batch's columns and returns, per shard, the rows
it gets and its plan ``(micro_batch_indices, micro_batch_lengths, elem_counts_per_gb)`` (see
:mod:`nrl_tasks.distributed.batched_data_dict` for their meaning).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, TypedDict

import torch

from nrl_tasks.distributed.batch_columns import positive_int
from nrl_tasks.distributed.dynamic_batching import plan_dynamic_shards
from nrl_tasks.distributed.sequence_packing import ShardPlan, plan_packed_shards

MicroBatchKind = Literal["dynamic", "packing"]


class DynamicBatchingCfg(TypedDict):
    """Dynamic batching settings for ``shard_by_batch_size`` (units: tokens)."""

    max_tokens_per_microbatch: int  # rows x padded length of a micro-batch never exceeds this
    sequence_length_round: int  # a micro-batch's length is rounded up to this multiple
    input_key: str  # column of input ids, [B, S]; S caps the padded length
    input_lengths_key: str  # column of per-row token counts, [B]


class SequencePackingCfg(TypedDict):
    """Sequence packing settings for ``shard_by_batch_size`` (units: tokens)."""

    max_tokens_per_microbatch: int  # bin capacity: padded tokens of all rows in a bin
    input_key: str  # column of input ids, [B, S]
    input_lengths_key: str  # column of per-row token counts, [B]
    algorithm: str  # "first_fit_decreasing" | "modified_first_fit_decreasing"
    sequence_length_pad_multiple: int  # each row's length is padded up to this multiple


def plan_shards(
    data: Mapping[str, Any],
    shards: int,
    batch_size: int,
    cfg: Mapping[str, Any],
    kind: MicroBatchKind,
) -> tuple[list[list[int]], list[ShardPlan]]:
    """Rows per shard (indices into ``data``'s rows) and each shard's micro-batch plan.

    ``data`` maps column names to columns (batch on dim 0); ``batch_size`` rows make one global
    batch. ``cfg`` is checked against the kind's settings and the batch: ``ValueError`` names
    a missing setting, a missing column, a non-``[B, S]`` input column or a length outside
    ``[0, S]``.
    """
    spec = DynamicBatchingCfg if kind == "dynamic" else SequencePackingCfg
    missing = [k for k in spec.__annotations__ if k not in cfg]
    if missing:
        raise ValueError(f"{spec.__name__} is missing {missing}")
    input_key, lengths_key = cfg["input_key"], cfg["input_lengths_key"]
    for key in (input_key, lengths_key):
        if key not in data:
            raise ValueError(f"column {key!r} named in {spec.__name__} is not in the batch "
                             f"(columns: {list(data)})")
    inputs, raw = data[input_key], data[lengths_key]
    if not isinstance(inputs, torch.Tensor) or inputs.ndim < 2:
        raise ValueError(f"column {input_key!r} must be a [B, S] tensor, got "
                         f"{getattr(inputs, 'shape', type(inputs).__name__)}")
    width = inputs.shape[1]
    lengths = raw.tolist() if isinstance(raw, torch.Tensor) else list(raw)
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= width:
            raise ValueError(f"row {i}: {lengths_key}={n!r} is not an int in [0, {width}] "
                             f"(the width of {input_key!r})")
    max_tokens = positive_int("max_tokens_per_microbatch", cfg["max_tokens_per_microbatch"])
    num_gb = len(lengths) // batch_size if batch_size else 0
    if kind == "dynamic":
        round_to = positive_int("sequence_length_round", cfg["sequence_length_round"])
        rows, ranges, padded = plan_dynamic_shards(
            lengths, width, shards, batch_size, max_tokens, round_to, lengths_key
        )
        return rows, [(ranges, padded, [batch_size // shards] * num_gb)] * shards
    multiple = positive_int("sequence_length_pad_multiple", cfg["sequence_length_pad_multiple"])
    return plan_packed_shards(
        lengths, shards, batch_size, max_tokens, cfg["algorithm"], multiple, lengths_key
    )
