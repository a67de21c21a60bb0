"""Micro-batch plan settings and the cfg-checked planner behind ``shard_by_batch_size``.

``DynamicBatchingCfg`` and ``SequencePackingCfg`` are the two plan kinds' settings (units:
tokens). They are ``TypedDict``s, so nothing checks them where they are built: ``check_cfg``
does where they are consumed, refusing unknown keys (a typo would otherwise be ignored) and
missing ones. ``plan_shards`` checks a cfg against a batch's columns and returns, per shard, the
rows it gets and its plan ``(micro_batch_indices, micro_batch_lengths, elem_counts_per_gb)`` (see
:mod:`nrl_tasks.distributed.batched_data_dict` for their meaning).
"""

from __future__ import annotations

import difflib
from typing import Any, Literal, Mapping, TypedDict

import torch

from nrl_tasks.distributed.dynamic_batching import plan_dynamic_shards
from nrl_tasks.distributed.sequence_packing import PACKING_ALGORITHMS, ShardPlan, plan_packed_shards

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


_POSITIVE_INTS = (
    "max_tokens_per_microbatch", "sequence_length_round", "sequence_length_pad_multiple"
)


def check_cfg(cfg: Any, kind: MicroBatchKind) -> None:
    """Check a ``DynamicBatchingCfg`` (``kind="dynamic"``) or a ``SequencePackingCfg``.

    Raises one ``ValueError`` listing every problem: unknown keys (with the closest allowed key
    and the allowed keys), missing keys, token counts that are not positive ints, an unknown
    packing algorithm. ``TypeError`` if ``cfg`` is not a mapping.
    """
    spec = DynamicBatchingCfg if kind == "dynamic" else SequencePackingCfg
    name = spec.__name__
    if not isinstance(cfg, Mapping):
        raise TypeError(f"{name} must be a dict, got {type(cfg).__name__}")
    allowed = list(spec.__annotations__)
    problems = []
    unknown = [k for k in cfg if k not in allowed]
    if unknown:
        guesses = {k: difflib.get_close_matches(str(k), allowed, n=1) for k in unknown}
        hint = ", ".join(f"{g[0]!r} for {k!r}" for k, g in guesses.items() if g)
        problems.append(f"{name} has unknown keys {unknown}"
                        + (f" (did you mean {hint}?)" if hint else "")
                        + f"; allowed keys: {allowed}")
    missing = [k for k in allowed if k in spec.__required_keys__ and k not in cfg]
    if missing:
        problems.append(f"{name} is missing {missing}")
    for key in (k for k in _POSITIVE_INTS if k in allowed and k in cfg):
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{key} must be a positive int, got {value!r}")
    if kind == "packing" and "algorithm" in cfg and cfg["algorithm"] not in PACKING_ALGORITHMS:
        problems.append(f"unknown sequence packing algorithm {cfg['algorithm']!r}; expected one "
                        f"of {PACKING_ALGORITHMS}")
    if problems:
        raise ValueError("; ".join(problems))


def plan_shards(
    data: Mapping[str, Any],
    shards: int,
    batch_size: int,
    cfg: Mapping[str, Any],
    kind: MicroBatchKind,
) -> tuple[list[list[int]], list[ShardPlan]]:
    """Rows per shard (indices into ``data``'s rows) and each shard's micro-batch plan.

    ``data`` maps column names to columns (batch on dim 0); ``batch_size`` rows make one global
    batch (0 only for a 0-row batch, which gets no global batch: every shard is empty and its
    plan lists nothing). ``cfg`` is checked (``check_cfg``), then against the batch:
    ``ValueError`` names a missing column, a non-``[B, S]`` input column or a length outside
    ``[0, S]``. A batch with no columns at all (``BatchedDataDict()``) has 0 rows and needs none.
    """
    check_cfg(cfg, kind)
    if not data:
        return [[] for _ in range(shards)], [([], [], []) for _ in range(shards)]
    spec = DynamicBatchingCfg if kind == "dynamic" else SequencePackingCfg
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
    max_tokens = cfg["max_tokens_per_microbatch"]
    if kind == "dynamic":
        round_to = cfg["sequence_length_round"]
        rows, ranges, padded = plan_dynamic_shards(
            lengths, width, shards, batch_size, max_tokens, round_to, lengths_key
        )
        counts = [batch_size // shards] * len(ranges)
        return rows, [(ranges, padded, counts) for _ in range(shards)]
    return plan_packed_shards(
        lengths, shards, batch_size, max_tokens, cfg["algorithm"],
        cfg["sequence_length_pad_multiple"], lengths_key,
    )
