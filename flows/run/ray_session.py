"""The flow process's Ray: connect to a cluster or start a local one, and stop the local one.

A local Ray started by the flow (no ``cluster.ray.address`` / ``RAY_ADDRESS`` and no Ray in the
process yet) belongs to the run: :func:`local_ray_session` names its session directory and
:func:`shutdown_local_ray` stops it (daemons included) when the flow ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import Iterator

from flows.config import MasterConfig
from nrl_tasks.distributed.virtual_cluster import init_ray, local_head_session_dir

__all__ = [
    "MAX_LOCAL_ACTORS_PER_CORE",
    "RAY_THREAD_PREFIXES",
    "check_local_ray_size",
    "connect_ray",
    "local_ray_cpus",
    "local_ray_session",
    "ray_connected",
    "shutdown_local_ray",
]

logger = logging.getLogger(__name__)


#: Actor processes a local Ray may run per core of this machine (fractional CPUs let a small
#: machine run a few light workers; a thousand would only thrash it).
MAX_LOCAL_ACTORS_PER_CORE = 4


def _uses_local_ray(cfg: MasterConfig) -> bool:
    return not (cfg.cluster.ray.address or os.environ.get("RAY_ADDRESS"))


def usable_gpus_per_node(cfg: MasterConfig) -> int:
    """``cluster.gpus_per_node``, or 0 for a local Ray on a machine without a GPU: a NeMo-RL file
    asks for GPUs (``cluster.gpus_per_node=1`` is its smallest size), and on this machine its
    workers run on CPU instead of waiting for a GPU that never comes (one warning line)."""
    n = cfg.cluster.gpus_per_node
    if n and _uses_local_ray(cfg):
        import torch

        if torch.cuda.device_count() == 0:
            logger.warning("cluster.gpus_per_node=%d but this machine has no GPU: the workers run on CPU", n)
            return 0
    return n


def check_local_ray_size(cfg: MasterConfig) -> None:
    """``ValueError`` when a local Ray would run more actor processes than this machine can hold
    (:data:`MAX_LOCAL_ACTORS_PER_CORE` per core). A cluster checks its own resources when the
    workers' placement groups are reserved (``RayVirtualCluster``)."""
    if not _uses_local_ray(cfg):
        return
    cores = os.cpu_count() or 1
    gen_workers = cfg.gen.num_workers if cfg.has_generation else 0  # a DPO run has none
    actors = cfg.cluster.policy_workers + gen_workers + (1 if cfg.env.reward_model.enabled else 0)
    cap = MAX_LOCAL_ACTORS_PER_CORE * cores
    if actors > cap:
        raise ValueError(
            f"a local Ray on this machine ({cores} cores) runs at most {cap} workers; this config asks for {actors} "
            f"(cluster.policy_workers={cfg.cluster.policy_workers}, generation.num_workers={gen_workers}"
            f"{', a reward model' if cfg.env.reward_model.enabled else ''}): lower them or set cluster.ray.address"
        )
    if cfg.cluster.ray.num_cpus is not None and cfg.cluster.ray.num_cpus > cap:
        raise ValueError(f"cluster.ray.num_cpus={cfg.cluster.ray.num_cpus} exceeds {cap} ({cores} cores here) for a local Ray")


def local_ray_cpus(cfg: MasterConfig) -> int:
    """Logical CPUs for a local Ray: every worker's share, at least the machine's cores."""
    need = cfg.cluster.policy_workers * max(cfg.cluster.num_cpus_per_worker, 0.0)
    if cfg.has_generation:
        need += cfg.gen.num_workers * max(cfg.gen.num_cpus_per_worker, 0.0)
    if cfg.env.reward_model.enabled:
        need += 1
    if cfg.teacher is not None or cfg.ppo is not None:  # distillation's teacher, PPO's value model: as many workers
        need += cfg.cluster.policy_workers * max(cfg.cluster.num_cpus_per_worker, 0.0)
    return int(max(os.cpu_count() or 1, need + 1))


def connect_ray(cfg: MasterConfig, namespace: str | None = None) -> str:
    """Connect to ``cluster.ray.address`` / ``RAY_ADDRESS`` or start a local Ray; GCS address.

    ``namespace``: the driver's Ray namespace when this process connects first. Placement groups
    are named in their creating driver's namespace, so a flow process uses its run's namespace
    (:func:`namespace_for`): the next flow process of the run (a resume) then finds and reuses
    them instead of reserving new ones, and a cleanup can remove them by name.
    """

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cfg.cluster.ray.address
    with _keep_sigterm_handler():
        if address or os.environ.get("RAY_ADDRESS"):
            return init_ray(address, namespace=namespace)
        check_local_ray_size(cfg)
        return init_ray(None, num_cpus=cfg.cluster.ray.num_cpus or local_ray_cpus(cfg), namespace=namespace)


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """``ray.init`` replaces the process's SIGTERM handler with its own (``sys.exit(15)``; a head
    it started: kill every Ray process, then ``sys.exit(1)``), which turns the CLI's clean stop
    into a crash in the middle of a stage. A handler the caller installed (a Python function) is
    put back; the default disposition is left to Ray."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and callable(before):
            signal.signal(signal.SIGTERM, before)


def ray_connected() -> bool:
    """Whether this process is connected to Ray already (then the flow reuses that Ray)."""
    import ray

    return bool(ray.is_initialized())


def local_ray_session() -> str | None:
    """Session directory of the local Ray head this process started, else ``None``."""

    return local_head_session_dir()


#: Name prefixes of this project's background threads that call Ray (fault hooks, refit watchdog).
RAY_THREAD_PREFIXES = ("nrl-fault", "nrl-refit")


def _ray_threads_finished(timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the :data:`RAY_THREAD_PREFIXES` threads; True when none is left."""
    me = threading.current_thread()
    threads = [th for th in threading.enumerate() if th is not me and th.name.startswith(RAY_THREAD_PREFIXES)]
    deadline = time.monotonic() + timeout_s
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    return not any(th.is_alive() for th in threads)


def shutdown_local_ray(run_id: str | None = None, *, thread_timeout_s: float = 15.0) -> bool:
    """Stop the local Ray head this process started (actors, raylet, GCS, agents; waits for the
    head's processes). False (nothing done) when this process only connected to a cluster or has
    no Ray. (``run_id`` is accepted for the callers' clarity; nothing is cached per run.)

    A thread that touches Ray after ``ray.shutdown()`` makes Ray end the whole process, so the
    project's Ray-calling background threads are waited for first (``thread_timeout_s``); if one
    is still busy, Ray is left to the process's exit (a warning says so)."""
    if local_ray_session() is None:
        return False
    if not _ray_threads_finished(thread_timeout_s):
        logger.warning("local Ray left running until this process exits: a background thread still uses it")
        return False
    import ray

    ray.shutdown(wait_for_processes=True)
    return True
