"""How a Policy's worker actors are built and placed: worker class, bundles, environment."""

from __future__ import annotations

import importlib
from typing import Any

from nrl_tasks.models.policy.workers.train_worker import PolicyWorker

__all__ = ["bundle_indices", "worker_class", "worker_env"]


def worker_class(worker_extension_cls_fqn: str | None) -> type:
    """``PolicyWorker``, or a subclass mixing in the class named ``"pkg.mod.Class"``."""
    if not worker_extension_cls_fqn:
        return PolicyWorker
    module_name, _, cls_name = worker_extension_cls_fqn.rpartition(".")
    if not module_name:
        raise ValueError(f"worker_extension_cls_fqn must be 'package.module.Class', got {worker_extension_cls_fqn!r}")
    try:
        ext = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import worker_extension_cls_fqn {worker_extension_cls_fqn!r}: {exc}") from exc
    return type(f"PolicyWorkerWith{cls_name}", (ext, PolicyWorker), {})


def bundle_indices(cluster: Any, workers_per_node: int | list[int] | None) -> list[tuple[int, int]]:
    """``(placement group, bundle)`` per worker: all bundles, or the first ``workers_per_node``
    bundles of each node entry (an int for every node, or one count per node)."""
    locations = cluster.bundle_locations()
    if workers_per_node is None:
        return locations
    counts = cluster.bundle_ct_per_node_list
    if isinstance(workers_per_node, int):
        wanted = [workers_per_node] * len(counts)
    else:
        wanted = list(workers_per_node)
        if len(wanted) != len(counts):
            raise ValueError(f"workers_per_node has {len(wanted)} entries for {len(counts)} nodes of the cluster")
    out = []
    for node, (want, have) in enumerate(zip(wanted, counts)):
        if isinstance(want, bool) or not isinstance(want, int) or not 0 <= want <= have:
            raise ValueError(f"workers_per_node[{node}]={want!r} must be an int in [0, {have}] (bundles on that node)")
        out += [(node, b) for b in range(want)]
    if not out:
        raise ValueError("workers_per_node selects no worker")
    return out


def worker_env(cfg: Any) -> dict[str, str]:
    """Environment of a worker process: thread caps, offline HF, deterministic cuBLAS."""
    threads = str(cfg.torch_num_threads)
    return {
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
