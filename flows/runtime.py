"""The live side of a run: Ray connection, Policy and generation actors, tokenizer, datasets.

One :class:`Runtime` per run id is cached in the flow process (tasks run there and look it up
with :func:`get_runtime`; a task in another process would attach by name). Actors are named and
detached in the Ray namespace ``nrl-<run_id>``: ``lm_policy-<rank>`` (trainer workers),
``generation-<rank>`` and, when configured, ``reward_model-<rank>``; placement groups are
``<run_id>-policy-pg0`` etc. With a Ray head node they outlive the flow process and a resumed
flow re-attaches; with a local Ray they die with it and resume re-creates them.

A local Ray started by :func:`setup_runtime` (no ``cluster.ray.address`` / ``RAY_ADDRESS`` and
no Ray in the process yet) belongs to the run: ``Runtime.ray_session_dir`` names its session
directory and :func:`shutdown_local_ray` stops it (daemons included) when the flow ends.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from flows.config import MasterConfig
from flows.run_layout import RunLayout

__all__ = [
    "Runtime",
    "connect_ray",
    "get_runtime",
    "local_ray_session",
    "namespace_for",
    "ray_connected",
    "register_runtime",
    "setup_runtime",
    "shutdown_local_ray",
    "shutdown_runtime",
]

logger = logging.getLogger(__name__)

_RUNTIMES: dict[str, "Runtime"] = {}
_LOCK = threading.Lock()


def namespace_for(run_id: str) -> str:
    """Ray namespace of a run's actors."""
    return f"nrl-{run_id}"


def local_ray_cpus(cfg: MasterConfig) -> int:
    """Logical CPUs for a local Ray: every worker's share, at least the machine's cores."""
    need = cfg.cluster.policy_workers * max(cfg.cluster.num_cpus_per_worker, 0.0)
    need += cfg.gen.num_workers * max(cfg.gen.num_cpus_per_worker, 0.0)
    if cfg.env.reward_model.enabled:
        need += 1
    return int(max(os.cpu_count() or 1, need + 1))


def connect_ray(cfg: MasterConfig, namespace: str | None = None) -> str:
    """Connect to ``cluster.ray.address`` / ``RAY_ADDRESS`` or start a local Ray; GCS address.

    ``namespace``: the driver's Ray namespace when this process connects first. Placement groups
    are named in their creating driver's namespace, so a flow process uses its run's namespace
    (:func:`namespace_for`): the next flow process of the run (a resume) then finds and reuses
    them instead of reserving new ones, and a cleanup can remove them by name.
    """
    from nrl_tasks.distributed.virtual_cluster import init_ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cfg.cluster.ray.address
    if address or os.environ.get("RAY_ADDRESS"):
        return init_ray(address, namespace=namespace)
    return init_ray(None, num_cpus=cfg.cluster.ray.num_cpus or local_ray_cpus(cfg), namespace=namespace)


def ray_connected() -> bool:
    """Whether this process is connected to Ray already (then the flow reuses that Ray)."""
    import ray

    return bool(ray.is_initialized())


def local_ray_session() -> str | None:
    """Session directory of the local Ray head this process started, else ``None``."""
    from nrl_tasks.distributed.virtual_cluster import local_head_session_dir

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
    head's processes) and forget ``run_id``'s cached handles. False (nothing done) when this
    process only connected to a cluster or has no Ray.

    A thread that touches Ray after ``ray.shutdown()`` makes Ray end the whole process, so the
    project's Ray-calling background threads are waited for first (``thread_timeout_s``); if one
    is still busy, Ray is left to the process's exit (a warning says so)."""
    if run_id is not None:
        drop_runtime(run_id)
    if local_ray_session() is None:
        return False
    if not _ray_threads_finished(thread_timeout_s):
        logger.warning("local Ray left running until this process exits: a background thread still uses it")
        return False
    import ray

    ray.shutdown(wait_for_processes=True)
    return True


def load_tokenizer(cfg: MasterConfig) -> Any:
    from transformers import AutoTokenizer

    pc = cfg.policy_config()
    return AutoTokenizer.from_pretrained(pc.tokenizer.name or pc.model_name)


@dataclass
class Runtime:
    """Handles of one run's actors plus what the stages read often (cached in this process)."""

    cfg: MasterConfig
    run_id: str
    layout: RunLayout
    namespace: str
    tokenizer: Any
    policy: Any = None
    generation: Any = None
    reward_model: Any = None
    clusters: dict[str, Any] = field(default_factory=dict)
    policy_attached: bool = False
    generation_attached: bool = False
    #: session directory of the local Ray that :func:`setup_runtime` started for this run
    ray_session_dir: str | None = None
    _records: dict[str, list[dict[str, str]]] = field(default_factory=dict)

    @property
    def storage_options(self) -> dict[str, Any] | None:
        return self.cfg.storage.storage_options or None

    @property
    def storage_kw(self) -> dict[str, Any]:
        """Keyword arguments for ``storage.load_batch`` and friends."""
        return {"storage_options": self.cfg.storage.storage_options} if self.cfg.storage.storage_options else {}

    def _snapshot(self, split: str) -> list[dict[str, str]]:
        """The run's frozen copy of a prompt split (``<run>/data/<split>``), made on first use."""
        if split in self._records:
            return self._records[split]
        import storage

        from flows.run_layout import join_uri
        from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
        from nrl_tasks.stages.data import load_prompt_records

        uri = join_uri(self.layout.run_uri, "data", split)
        if storage.is_committed(uri, **self.storage_kw):
            b = storage.load_batch(uri, **self.storage_kw)
            recs = [{"prompt": p, "answer": a} for p, a in zip(b["prompt"], b["answer"])]
        else:
            recs = load_prompt_records(self.cfg.data, split, self.cfg.grpo.seed, self.cfg.storage.storage_options)
            if self.tokenizer is not None:  # over-long prompts: one clear error now, not at step k
                from nrl_tasks.stages.data import check_prompt_lengths

                src = getattr(self.cfg.data, f"{split}_path", None) or f"{self.cfg.data.dataset} {split} split"
                check_prompt_lengths(recs, self.cfg.data, self.tokenizer, self.cfg.max_prompt_tokens(), source=src)
            batch = BatchedDataDict({"prompt": [r["prompt"] for r in recs], "answer": [r["answer"] for r in recs]})
            storage.save_batch(batch, uri, **self.storage_kw, run_id=self.run_id, stage=f"data-{split}", step=0)
        self._records[split] = recs
        return recs

    def train_records(self) -> list[dict[str, str]]:
        return self._snapshot("train")

    def val_records(self) -> list[dict[str, str]]:
        return self._snapshot("val")

    # ------------------------------------------------------------------ actors
    def _cluster(self, role: str, workers: int, cpus: float) -> Any:
        from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster

        name = f"{self.run_id}-{role}"
        ray_cfg = self.cfg.cluster.ray  # custom resources pin a group to the nodes that have them
        extra = {"policy": ray_cfg.policy_resources, "generation": ray_cfg.generation_resources}.get(role)
        cl = RayVirtualCluster(
            [workers],
            use_gpus=self.cfg.cluster.gpus_per_node > 0,
            num_gpus_per_node=self.cfg.cluster.gpus_per_node,
            name=name,
            namespace=self.namespace,
            num_cpus_per_bundle=cpus,
            resources_per_bundle=dict(extra or {}),
        )
        self.clusters[role] = cl
        return cl

    def start_policy(self, *, fresh: bool = False) -> bool:
        """Attach to the run's Policy actors or create them. Returns True when attached."""
        from nrl_tasks.models.policy.lm_policy import Policy

        cfg = self.cfg
        pc = cfg.policy_config()
        if not fresh:
            try:
                self.policy = Policy.attach(pc, self.tokenizer, name_prefix="lm_policy", namespace=self.namespace)
                self.policy_attached = True
                return True
            except (LookupError, RuntimeError) as exc:
                logger.info("no live policy to attach to (%s): creating it", exc)
        cl = self._cluster("policy", cfg.cluster.policy_workers, cfg.cluster.num_cpus_per_worker)
        self.policy = Policy(cl, pc, self.tokenizer, name_prefix="lm_policy", namespace=self.namespace)
        self.policy_attached = False
        return False

    def start_generation(self, *, fresh: bool = False) -> bool:
        """Attach to the run's generation workers or create them. Returns True when attached."""
        from nrl_tasks.models.generation.hf_generation import HfGeneration

        gen = self.cfg.generation_config()
        if not fresh:
            try:
                self.generation = HfGeneration.attach(name_prefix="generation", namespace=self.namespace)
                self.generation_attached = True
                return True
            except LookupError:
                pass
        if gen.backend == "vllm":  # pragma: no cover - GPU only
            from nrl_tasks.models.generation.vllm_generation import VllmGeneration

            cls: Any = VllmGeneration
        else:
            cls = HfGeneration
        cl = self._cluster("generation", gen.num_workers, gen.num_cpus_per_worker)
        self.generation = cls(cl, gen, name_prefix="generation", namespace=self.namespace)
        self.generation_attached = False
        return False

    def start_reward_model(self) -> None:
        """A sequence-classification Policy used by ``score`` when ``env.reward_model.enabled``."""
        if not self.cfg.env.reward_model.enabled:
            return
        from nrl_tasks.models.policy.lm_policy import Policy

        from flows.models import resolve_model_path

        data = self.cfg.policy_config().model_dump(mode="json")
        data.update(
            model_name=resolve_model_path(self.cfg.env.reward_model.model_name),
            tokenizer={"name": None},
            reward_model_cfg={"enabled": True},
        )
        rm_cfg = type(self.cfg.policy).model_validate(data)
        try:
            self.reward_model = Policy.attach(rm_cfg, self.tokenizer, name_prefix="reward_model", namespace=self.namespace)
        except LookupError:
            cl = self._cluster("reward", 1, 0.0)
            self.reward_model = Policy(
                cl, rm_cfg, self.tokenizer, name_prefix="reward_model", namespace=self.namespace,
                init_optimizer=False, init_reference_model=False,
            )

    def shutdown(self) -> None:
        """Kill the actors and remove the placement groups (idempotent)."""
        for name in ("generation", "policy", "reward_model"):
            h = getattr(self, name)
            if h is not None:
                try:
                    h.shutdown()
                except Exception as exc:  # noqa: BLE001 - best effort at teardown
                    logger.warning("shutdown of %s failed: %s", name, exc)
                setattr(self, name, None)
        for role, cl in list(self.clusters.items()):
            try:
                cl.shutdown()
            except Exception as exc:  # noqa: BLE001
                logger.warning("placement group removal (%s) failed: %s", role, exc)
        self.clusters.clear()
        for role in ("policy", "generation", "reward"):
            try:
                from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster

                RayVirtualCluster.attach(f"{self.run_id}-{role}", self.namespace, pg_timeout_s=5).shutdown()
            except Exception:  # noqa: BLE001 - none left
                pass


def register_runtime(rt: Runtime) -> Runtime:
    with _LOCK:
        _RUNTIMES[rt.run_id] = rt
    return rt


def setup_runtime(
    cfg: MasterConfig,
    run_id: str,
    *,
    with_actors: bool = True,
    on_connect: Callable[[Runtime], None] | None = None,
) -> Runtime:
    """Connect Ray, load the tokenizer, attach to or create the run's actors; cache and return.

    The storage retry policy (``storage.retry``) is applied and the train data snapshot is taken
    (bad prompt files fail here) before Ray is touched. ``on_connect(rt)`` runs once Ray is up,
    before any actor (``rt.ray_session_dir`` is set when this call started a local Ray).
    """
    import storage.retry

    storage.retry.set_retry_policy(cfg.storage.retry.policy())
    rt = Runtime(
        cfg=cfg,
        run_id=run_id,
        layout=RunLayout(cfg.storage.root, run_id),
        namespace=namespace_for(run_id),
        tokenizer=load_tokenizer(cfg),
    )
    if with_actors:
        rt.train_records()
    fresh = not ray_connected()
    connect_ray(cfg, namespace=rt.namespace)
    rt.ray_session_dir = local_ray_session() if fresh else None
    if on_connect is not None:
        on_connect(rt)
    if with_actors:
        rt.start_policy()
        rt.start_generation()
        rt.start_reward_model()
    return register_runtime(rt)


def get_runtime(cfg: MasterConfig, run_id: str) -> Runtime:
    """The cached runtime of ``run_id`` (set up by the flow); attaches by name if missing."""
    with _LOCK:
        rt = _RUNTIMES.get(run_id)
    if rt is not None:
        return rt
    return setup_runtime(cfg, run_id)


def shutdown_runtime(run_id: str) -> None:
    with _LOCK:
        rt = _RUNTIMES.pop(run_id, None)
    if rt is not None:
        rt.shutdown()


def drop_runtime(run_id: str) -> None:
    """Forget the cached handles without killing anything (e.g. after a crash test)."""
    with _LOCK:
        _RUNTIMES.pop(run_id, None)
