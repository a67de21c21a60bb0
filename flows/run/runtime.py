"""A run's live side: its Ray actors, and the :class:`~nrl_tasks.stages.context.RunContext` built on them.

:func:`setup_runtime` connects Ray (:mod:`flows.run.ray_session`), loads the tokenizer and attaches to
or creates the run's actors; :func:`build_run_context` wraps them, the layout, the config and the
observers (:mod:`flows.run.plugins`) into the context every stage receives. Nothing is cached in this
module: the flow holds the context for the run and passes it on.

Actors are named and detached in the Ray namespace ``nrl-<run_id>``: ``lm_policy-<rank>``
(trainer workers), ``generation-<rank>`` (none with ``generation.colocated.enabled``: the policy
workers sample) and, when configured, ``reward_model-<rank>``; placement
groups are ``<run_id>-policy-pg0`` etc. With a Ray head node they outlive the flow process and a
resumed flow re-attaches (:meth:`Runtime.start_policy` tries to attach first); with a local Ray
they die with it and resume re-creates them.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from flows.config import MasterConfig
from flows.run.ray_session import connect_ray, local_ray_session, ray_connected, shutdown_local_ray, usable_gpus_per_node
from flows.run.recipe import Actors
from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
from nrl_tasks.environments.loading import EnvironmentWorkers
from nrl_tasks.models.builtin import resolve_model_path
from nrl_tasks.models.generation.hf_generation import HfGeneration
from nrl_tasks.models.policy.lm_policy import Policy
from nrl_tasks.run_layout import RunLayout, namespace_for
from nrl_tasks.stages.context import Observers, RunContext
from nrl_tasks.stages.graph import GRPO_GRAPH, StageGraph

__all__ = [
    "Runtime",
    "build_run_context",
    "connect_ray",
    "load_tokenizer",
    "local_ray_session",
    "namespace_for",
    "ray_connected",
    "recreate_generation",
    "recreate_policy",
    "setup_runtime",
    "shutdown_local_ray",
]

logger = logging.getLogger(__name__)


def load_tokenizer(cfg: MasterConfig) -> Any:
    from transformers import AutoTokenizer

    pc = cfg.policy_config()
    return AutoTokenizer.from_pretrained(pc.tokenizer.name or pc.model_name)


@dataclass
class Runtime:
    """The run's actor groups (the :class:`~nrl_tasks.stages.context.RunActors` of its context)."""

    cfg: MasterConfig
    run_id: str
    layout: RunLayout
    namespace: str
    tokenizer: Any
    policy: Any = None
    generation: Any = None
    reward_model: Any = None
    teacher: Any = None
    value: Any = None  # PPO's value model
    environment: Any = None  # EnvironmentWorkers when env.environment is set
    clusters: dict[str, Any] = field(default_factory=dict)
    policy_attached: bool = False
    generation_attached: bool = False
    #: session directory of the local Ray that :func:`setup_runtime` started for this run
    ray_session_dir: str | None = None
    #: the run's data snapshots (``{"train": [...]}``), taken by its recipe before Ray started
    records: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    #: whether the policy workers keep a copy of the initial weights (the reference policy, which a
    #: KL term reads): a model's worth of memory in each worker, so only when the recipe needs it
    reference_weights: bool = True

    # ------------------------------------------------------------------ actors
    def _cluster(self, role: str, workers: int, cpus: float) -> Any:
        name = f"{self.run_id}-{role}"
        ray_cfg = self.cfg.cluster.ray  # custom resources pin a group to the nodes that have them
        extra = {"policy": ray_cfg.policy_resources, "generation": ray_cfg.generation_resources}.get(role)
        gpus = usable_gpus_per_node(self.cfg)
        cl = RayVirtualCluster(
            [workers],
            use_gpus=gpus > 0,
            num_gpus_per_node=gpus,
            name=name,
            namespace=self.namespace,
            num_cpus_per_bundle=cpus,
            resources_per_bundle=dict(extra or {}),
        )
        self.clusters[role] = cl
        return cl

    def start_policy(self, *, fresh: bool = False) -> bool:
        """Attach to the run's Policy actors or create them. Returns True when attached."""

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
        self.policy = Policy(cl, pc, self.tokenizer, name_prefix="lm_policy", namespace=self.namespace,
                             init_reference_model=self.reference_weights)
        self.policy_attached = False
        if self.generation is not None and self.generation.shares_policy_weights:
            self.start_generation(fresh=True)  # colocated: sample on the new workers (version 0, as they are)
        return False

    def start_generation(self, *, fresh: bool = False) -> bool:
        """Attach to the run's generation workers or create them. Returns True when attached."""

        gen = self.cfg.generation_config()
        if gen.colocated.enabled:  # sampling inside the policy workers: no actors of its own
            from nrl_tasks.models.generation.colocated import ColocatedGeneration

            self.generation = ColocatedGeneration(self.policy)
            self.generation_attached = False
            return False
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

        data = self.cfg.policy_config().model_dump(mode="json")
        data.update(
            model_name=resolve_model_path(self.cfg.env.reward_model.model_name),
            tokenizer={"name": None},
            reward_model_cfg={"enabled": True},
            num_cpus_per_worker=None,  # its bundle's share
        )
        rm_cfg = type(self.cfg.policy).model_validate(data)
        try:
            self.reward_model = Policy.attach(rm_cfg, self.tokenizer, name_prefix="reward_model", namespace=self.namespace)
        except LookupError:
            # one CPU: a local Ray counts one for it (flows.run.ray_session.local_ray_cpus); a CPU-only
            # bundle of none cannot be placed
            cl = self._cluster("reward", 1, 1.0)
            self.reward_model = Policy(
                cl, rm_cfg, self.tokenizer, name_prefix="reward_model", namespace=self.namespace,
                init_optimizer=False, init_reference_model=False,
            )

    def start_teacher(self, *, fresh: bool = False) -> None:
        """On-policy distillation's teacher: the ``teacher`` policy config (the student's
        generation temperature divides its logits too), without optimizer or reference model, in
        ``cluster.policy_workers`` workers of its own. ``fresh``: kill a live one and make it again."""
        if self.cfg.teacher is None:
            return
        if fresh:
            _kill_group(self, "teacher", "teacher")
        data = self.cfg.teacher.model_dump(mode="json")
        data.update(model_name=resolve_model_path(self.cfg.teacher.model_name),
                    generation=self.cfg.generation_config().model_dump(mode="json"))
        if self.cfg.teacher.tokenizer.name:
            data["tokenizer"] = {**data["tokenizer"], "name": resolve_model_path(self.cfg.teacher.tokenizer.name)}
        t_cfg = type(self.cfg.teacher).model_validate(data)
        if not fresh:
            try:
                self.teacher = Policy.attach(t_cfg, self.tokenizer, name_prefix="teacher", namespace=self.namespace)
                return
            except (LookupError, RuntimeError):
                pass
        cl = self.clusters.get("teacher") or self._cluster("teacher", self.cfg.cluster.policy_workers,
                                                           self.cfg.cluster.num_cpus_per_worker)
        self.teacher = Policy(cl, t_cfg, self.tokenizer, name_prefix="teacher", namespace=self.namespace,
                              init_optimizer=False, init_reference_model=False)

    def start_value(self, *, fresh: bool = False) -> bool:
        """PPO's value model (:meth:`MasterConfig.value_config`: a one-output head, trained), in
        ``cluster.policy_workers`` workers of its own. Attach to the run's or create it (``fresh``:
        kill a live one and create it: initial weights, version 0). Returns True when attached."""
        if self.cfg.ppo is None:
            return False
        v_cfg = self.cfg.value_config()
        if fresh:
            _kill_group(self, "value", "value")
        else:
            try:
                self.value = Policy.attach(v_cfg, self.tokenizer, name_prefix="value", namespace=self.namespace)
                return True
            except (LookupError, RuntimeError) as exc:
                logger.info("no live value model to attach to (%s): creating it", exc)
        cl = self.clusters.get("value") or self._cluster("value", self.cfg.cluster.policy_workers,
                                                         self.cfg.cluster.num_cpus_per_worker)
        self.value = Policy(cl, v_cfg, self.tokenizer, name_prefix="value", namespace=self.namespace,
                            init_optimizer=True, init_reference_model=False)
        return False

    def start_environment(self) -> None:
        """The ``env.environment`` actors (``env.num_workers``), made fresh for each flow process:
        an environment keeps no state between calls (the episode's state is its metadata)."""
        env = self.cfg.env
        if env.environment is None or self.environment is not None:
            return

        self.environment = EnvironmentWorkers(
            env.environment, env.environment_kwargs, env.num_workers, namespace=self.namespace, step_timeout_s=env.step_timeout_s,
        )

    def stop_environment(self) -> None:
        """Kill the environment's actors (idempotent; the next flow process makes its own)."""
        if self.environment is not None:
            self.environment.shutdown()
            self.environment = None

    def shutdown(self) -> None:
        """Kill the actors and remove the placement groups (idempotent)."""
        for name in ("environment", "generation", "policy", "reward_model", "teacher", "value"):
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
        for role in ("policy", "generation", "reward", "teacher", "value"):
            try:
                from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster

                RayVirtualCluster.attach(f"{self.run_id}-{role}", self.namespace, pg_timeout_s=5).shutdown()
            except Exception:  # noqa: BLE001 - none left
                pass


def _kill_group(rt: Runtime, role: str, prefix: str) -> None:
    """Kill a worker group (whatever state its ranks are in), also ranks the handle does not know."""
    handle = getattr(rt, role)
    if handle is not None:
        try:
            handle.worker_group.shutdown(force=True)
        except Exception as exc:  # noqa: BLE001 - already gone
            logger.debug("%s shutdown: %s", role, exc)
    setattr(rt, role, None)
    try:  # ranks of another world size: kill by name
        from nrl_tasks.distributed.worker_groups import RayWorkerGroup

        RayWorkerGroup.attach(prefix, rt.namespace).shutdown(force=True)
    except Exception:  # noqa: BLE001 - none left
        pass


def _recreate(rt: Runtime, role: str, reason: str, log: Any) -> None:
    """Kill the ``role`` worker group and start fresh actors (initial weights, version 0)."""
    what = {"policy": "policy workers", "generation": "generation workers"}[role]
    log.warning("re-creating the %s: %s", what, reason)
    t = time.perf_counter()
    _kill_group(rt, role, {"policy": "lm_policy", "generation": "generation"}[role])
    (rt.start_policy if role == "policy" else rt.start_generation)(fresh=True)
    log.warning("%s re-created in %.1fs", what, time.perf_counter() - t)


def recreate_policy(rt: Runtime, reason: str, log: Any = logger) -> None:
    """Kill the policy worker group and start fresh actors (initial weights, version 0)."""
    _recreate(rt, "policy", reason, log)


def recreate_generation(rt: Runtime, reason: str, log: Any = logger) -> None:
    """Kill the generation worker group and start fresh workers (initial weights, version 0)."""
    _recreate(rt, "generation", reason, log)


def setup_runtime(
    cfg: MasterConfig,
    run_id: str,
    *,
    actors: Actors = Actors(generation=True, reward_model=True, environment=True),
    records: dict[str, list[dict[str, str]]] | None = None,
    tokenizer: Any = None,
    on_connect: Callable[[Runtime], None] | None = None,
    reference_weights: bool = True,
) -> Runtime:
    """Connect Ray, attach to or create the run's policy and the ``actors`` its recipe uses
    (generation workers, the reward model and the environment when the config has them).

    ``records``: the run's data snapshots, taken by its recipe before Ray is touched (so a bad
    data file fails before anything starts); ``tokenizer``: the one already loaded (default: the
    config's). ``on_connect(rt)`` runs once Ray is up, before any actor (``rt.ray_session_dir`` is
    set when this call started a local Ray). ``reference_weights``: whether a policy this call
    creates keeps the initial weights (its recipe's :meth:`~flows.run.recipe.Recipe.reference_weights`).
    """
    rt = Runtime(
        cfg=cfg,
        run_id=run_id,
        layout=RunLayout(cfg.storage.root, run_id),
        namespace=namespace_for(run_id),
        tokenizer=tokenizer if tokenizer is not None else load_tokenizer(cfg),
        records=dict(records or {}),
        reference_weights=reference_weights,
    )
    fresh = not ray_connected()
    connect_ray(cfg, namespace=rt.namespace)
    rt.ray_session_dir = local_ray_session() if fresh else None
    if on_connect is not None:
        on_connect(rt)
    colocated = bool(actors.generation) and cfg.gen.colocated.enabled
    starts: list[Callable[[], Any]] = [rt.start_policy]
    for wanted, start in ((actors.generation and not colocated, rt.start_generation),
                          (actors.reward_model, rt.start_reward_model), (actors.teacher, rt.start_teacher),
                          (actors.value, rt.start_value), (actors.environment, rt.start_environment)):
        if wanted:
            starts.append(start)
    _start_together(starts)
    if actors.generation and colocated:  # sampling inside the policy workers: after them
        rt.start_generation()
    return rt


def _start_together(starts: list[Callable[[], Any]]) -> None:
    """Run the actor groups' starts at once: each waits on its own actors' processes (imports,
    model load), which overlap. Every start ends before this returns; the first error is raised."""
    if len(starts) == 1:
        starts[0]()
        return
    with ThreadPoolExecutor(max_workers=len(starts), thread_name_prefix="nrl-start") as pool:
        futures = [pool.submit(start) for start in starts]
    for fut in futures:
        fut.result()


def build_run_context(
    cfg: MasterConfig,
    run_id: str,
    actors: Any,
    tokenizer: Any,
    observers: Observers | None = None,
    *,
    records: dict[str, list[dict[str, str]]] | None = None,
    graph: StageGraph = GRPO_GRAPH,
) -> RunContext:
    """The run's context (one per run; the flow passes it, per step, to every stage).
    ``records``: data snapshots already taken (``{"train": [...]}``); ``graph``: the stage graph
    of the run's algorithm."""
    run = RunContext(
        run_id=run_id,
        layout=RunLayout(cfg.storage.root, run_id),
        cfg=cfg,
        tokenizer=tokenizer,
        actors=actors,
        observers=observers or Observers(),
        graph=graph,
    )
    for split, recs in (records or {}).items():
        run.remember_records(split, recs)
    return run
