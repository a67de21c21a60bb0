"""A one-rank ``PolicyWorker`` in this process, without Ray (tests, ``benchmarks.gpu_check``)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from nrl_tasks.models.policy.workers.train_worker import PolicyWorker
from nrl_tasks.utils.collective import find_free_port

__all__ = ["in_process_worker"]


@contextlib.contextmanager
def in_process_worker(cfg: Any) -> Iterator[Any]:
    """A set-up one-rank ``PolicyWorker`` for ``cfg`` (a ``PolicyConfig``); the process-wide
    torch settings it changes (threads, deterministic algorithms, RNG states) are restored on
    exit, and its process group is destroyed. ``RuntimeError`` when this process already has a
    default ``torch.distributed`` group."""
    import torch.distributed as dist

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
