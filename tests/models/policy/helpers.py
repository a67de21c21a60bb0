"""Synthetic batches for the policy tests (deterministic, tiny-model vocabulary)."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict


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


@contextlib.contextmanager
def in_process_worker(cfg):
    """A set-up one-rank ``PolicyWorker`` in this process (gloo group of one).

    The worker seeds RNGs, fixes the thread count and enables deterministic algorithms; all of
    that process-global state is restored on exit, and the process group is destroyed.
    """
    import torch.distributed as dist

    from nrl_tasks.models.policy.workers.train_worker import PolicyWorker
    from nrl_tasks.utils.collective import find_free_port

    if dist.is_initialized():
        raise RuntimeError("a default process group already exists in this process")
    threads = torch.get_num_threads()
    det, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    worker = PolicyWorker(cfg.model_dump(mode="json"), None)
    try:
        worker.setup("127.0.0.1", find_free_port())
        yield worker
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det, warn_only=warn)
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
