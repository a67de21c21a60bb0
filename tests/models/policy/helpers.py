"""Synthetic batches for the policy tests (deterministic, tiny-model vocabulary)."""

from __future__ import annotations


import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.models.policy import PolicyConfig


def policy_config(model_dir: str, **overrides) -> PolicyConfig:
    """The small policy config of the Ray policy tests (gbs 8, mbs 2, lr 1e-3), with ``overrides``."""
    base = dict(
        model_name=model_dir,
        train_global_batch_size=8,
        train_micro_batch_size=2,
        logprob_batch_size=4,
        max_total_sequence_length=64,
        optimizer={"kwargs": {"lr": 1e-3, "weight_decay": 0.01}},
        generation={"temperature": 0.8, "max_new_tokens": 6},
        num_cpus_per_worker=0.5,
    )
    base.update(overrides)
    return PolicyConfig(**base)


def make_batch(rows: int, width: int, *, seed: int = 0, vocab: int = 300, pad_id: int = 0, min_len: int = 3,
               prompt_len: int = 2, rl_keys: bool = True) -> BatchedDataDict:
    """Right-padded ``input_ids [rows, width]`` with varied lengths, masks and (optionally) the
    GRPO loss inputs (``advantages``, ``prev_logprobs``, ``generation_logprobs``,
    ``reference_policy_logprobs``; position 0 is 0)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, width + 1, (rows,), generator=g)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    positions = torch.arange(width).unsqueeze(0)
    valid = positions < lengths.unsqueeze(1)
    ids = torch.where(valid, ids, torch.full_like(ids, pad_id))
    token_mask = (valid & (positions >= prompt_len)).float()
    batch = BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": lengths,
            "token_mask": token_mask,
            "sample_mask": torch.ones(rows),
        }
    )
    if rl_keys:
        adv = torch.randn(rows, generator=g).unsqueeze(1).expand(rows, width).contiguous()
        base = -6.0 + 0.1 * torch.randn(rows, width, generator=g)
        base[:, 0] = 0
        batch["advantages"] = adv * valid
        batch["prev_logprobs"] = base * valid
        batch["generation_logprobs"] = base * valid
        batch["reference_policy_logprobs"] = (base + 0.05) * valid
    return batch


