"""Input checks and small batch helpers for :class:`~.train_worker.PolicyWorker`.

``check_inputs`` validates the keys and shapes every worker call needs; ``with_default_masks``
fills in the masks ``train`` needs when a batch has none; ``on_device`` and ``to_float`` move a
micro-batch to the worker's device and turn a loss metric into a plain float.
"""

from __future__ import annotations

from typing import Any

import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.models.policy.workers.logprobs import length_mask

__all__ = ["check_inputs", "on_device", "to_float", "with_default_masks"]


def check_inputs(data: BatchedDataDict) -> None:
    """Raise ``ValueError`` unless ``data`` has ``input_ids [B, S]`` and ``input_lengths [B]`` tensors."""
    for key in ("input_ids", "input_lengths"):
        if key not in data:
            raise ValueError(f"batch is missing key {key!r} (have {sorted(data.keys())})")
    ids, lengths = data["input_ids"], data["input_lengths"]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        raise ValueError(f"input_ids must be a [B, S] tensor, got {getattr(ids, 'shape', type(ids).__name__)}")
    if not isinstance(lengths, torch.Tensor) or lengths.shape != (ids.shape[0],):
        raise ValueError(f"input_lengths must be a [B] tensor for input_ids {tuple(ids.shape)}")


def with_default_masks(data: BatchedDataDict) -> BatchedDataDict:
    """Add ``token_mask`` (positions < length) and ``sample_mask`` (ones) when absent."""
    if "token_mask" in data and "sample_mask" in data:
        return data
    out = type(data)(dict(data))
    for attr in ("micro_batch_kind", "micro_batch_indices", "micro_batch_lengths", "elem_counts_per_gb"):
        setattr(out, attr, getattr(data, attr))
    if "token_mask" not in out:
        out["token_mask"] = length_mask(data["input_lengths"], data["input_ids"].shape[1]).to(torch.float32)
    if "sample_mask" not in out:
        out["sample_mask"] = torch.ones(data.size, dtype=torch.float32)
    return out


def on_device(mb: BatchedDataDict, device: torch.device) -> BatchedDataDict:
    """``mb`` on ``device`` (unchanged on CPU)."""
    return mb if device.type == "cpu" else mb.to(device)


def to_float(value: Any) -> Any:
    """A tensor metric as a float (its mean; 0.0 if empty); anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().mean()) if value.numel() else 0.0
    return value
