"""Driver-side sharding of batches for policy workers, and merging of their results.

``shard_for_logprob`` / ``shard_for_train`` cut a batch into one shard per data-parallel rank,
attaching the dynamic-batching or sequence-packing micro-batch plan the workers follow (see
:mod:`nrl_tasks.distributed.batched_data_dict`). ``merge_results`` concatenates per-shard
outputs and undoes the reordering those plans imply.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict, SlicedDataDict

__all__ = ["dynamic_cfg", "merge_results", "packing_cfg", "payload_bytes", "shard_for_logprob", "shard_for_train"]


def dynamic_cfg(cfg: Any, tokens: int | None) -> dict[str, Any]:
    """``DynamicBatchingCfg`` for ``shard_by_batch_size`` from ``PolicyConfig``."""
    return {
        "max_tokens_per_microbatch": int(tokens),
        "sequence_length_round": cfg.dynamic_batching.sequence_length_round,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
    }


def packing_cfg(cfg: Any, tokens: int | None) -> dict[str, Any]:
    """``SequencePackingCfg`` for ``shard_by_batch_size`` from ``PolicyConfig``."""
    sp = cfg.sequence_packing
    return {
        "max_tokens_per_microbatch": int(tokens),
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "algorithm": sp.algorithm,
        "sequence_length_pad_multiple": sp.sequence_length_pad_multiple,
    }


def shard_for_logprob(
    data: BatchedDataDict[Any], dp: int, cfg: Any
) -> tuple[list[SlicedDataDict], Optional[list[int]]]:
    """``(shards, unsorted_data_indices)`` for logprob-like calls.

    With dynamic batching or packing (``*.logprob_mb_tokens``) rows are reordered and the indices
    restore the order (``from_batches(results).reorder_data(indices)``); otherwise ``None``.
    Batches that do not divide across the ranks (or, for packing, have fewer rows than ranks)
    fall back to plain, possibly uneven, shards.
    """
    size = data.size
    if cfg.dynamic_batching.enabled and size and size % dp == 0:
        shards, indices = data.shard_by_batch_size(
            dp, dynamic_batching_cfg=dynamic_cfg(cfg, cfg.dynamic_batching.logprob_mb_tokens)
        )
        return shards, indices
    if cfg.sequence_packing.enabled and size >= dp:
        shards, indices = data.shard_by_batch_size(
            dp, sequence_packing_cfg=packing_cfg(cfg, cfg.sequence_packing.logprob_mb_tokens)
        )
        return shards, indices
    return data.shard_by_batch_size(dp, allow_uneven_shards=size % dp != 0), None


def shard_for_train(data: BatchedDataDict[Any], dp: int, cfg: Any, batch_size: int) -> list[SlicedDataDict]:
    """Shards for ``train``: global batches of ``batch_size`` rows split across ``dp`` ranks
    (plans from ``train_mb_tokens``; no reorder indices: ``train`` returns scalars)."""
    if cfg.dynamic_batching.enabled:
        shards, _ = data.shard_by_batch_size(
            dp, batch_size=batch_size, dynamic_batching_cfg=dynamic_cfg(cfg, cfg.dynamic_batching.train_mb_tokens)
        )
        return shards
    if cfg.sequence_packing.enabled:
        shards, _ = data.shard_by_batch_size(
            dp, batch_size=batch_size, sequence_packing_cfg=packing_cfg(cfg, cfg.sequence_packing.train_mb_tokens)
        )
        return shards
    return data.shard_by_batch_size(dp, batch_size=batch_size)


def merge_results(results: list[Any], unsorted: Optional[list[int]]) -> BatchedDataDict:
    """Concatenate per-shard results (right-padding like ``from_batches``) in original row order."""
    merged = BatchedDataDict.from_batches(results)
    if unsorted is not None:
        merged.reorder_data(unsorted)
    return merged


def payload_bytes(value: Any) -> int:
    """Approximate bytes of a shard's column (exact for tensors)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(payload_bytes(v) for v in value.values())
    if isinstance(value, (str, bytes)):
        return len(value)
    return 8
