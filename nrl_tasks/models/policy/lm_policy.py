"""``Policy``: a persistent, Ray-hosted, data-parallel trainer of a Hugging Face causal LM (seed 003).

Each data-parallel rank is a named, detached Ray actor ``f"{name_prefix}-{rank}"``
(:class:`~nrl_tasks.models.policy.workers.train_worker.PolicyWorker`) in namespace
``namespace`` (convention ``f"nrl-{run_id}"``). The driver-side ``Policy`` is a thin handle:
it shards batches, dispatches calls and aggregates results.

Persistence: building a ``Policy`` whose actors already run (same names, same config) attaches
to them with their current weights, optimizer state and version; ``Policy.attach`` does the same
from any process connected to the Ray cluster. The actors live until ``shutdown()`` is called
(by any process) or the Ray cluster stops. ``__del__`` therefore never kills detached actors:
a flow process that crashes or exits must leave them for the next one. Only non-detached
groups (``detached=False``) created by this object are shut down by ``__del__``; those die with
their driver anyway.

Actors found half alive (some dead, or set up with a different world size) are killed and
re-created: their state is lost and must be restored from a checkpoint (``load_checkpoint``).

Methods by concern: this module holds construction/attach, dispatch, sharding, inference,
training and shutdown; the refit producer side is in
:mod:`~nrl_tasks.models.policy.lm_policy_refit`, checkpoints in
:mod:`~nrl_tasks.models.policy.lm_policy_checkpoint`, device lifecycle/profiling in
:mod:`~nrl_tasks.models.policy.lm_policy_lifecycle` (mixins of ``Policy``).

Not supported (Megatron/SGLang/CUDA-IPC only in NeMo-RL): ``calibrate_qkv_fp8_scales``,
``init_collective_mcore_generation``, ``preinit_nvshmem``, ``swap_weights_via_reshard``,
``nccl_reshard_*``, ``stream_weights_via_http``, ``stream_weights_via_ipc_zmq``,
``get_full_logits_ipc``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterable, Optional, Union

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict, SlicedDataDict
from nrl_tasks.distributed.worker_groups import RayWorkerGroup
from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.models.policy.lm_policy_checkpoint import PolicyCheckpointMethods
from nrl_tasks.models.policy.lm_policy_lifecycle import PolicyLifecycleMethods
from nrl_tasks.models.policy.lm_policy_refit import PolicyRefitMethods
from nrl_tasks.models.policy.workers import sharding
from nrl_tasks.models.policy.workers.parallel import layout_for
from nrl_tasks.models.policy.workers.placement import bundle_indices, worker_class, worker_env

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["Policy", "PathLike"]

#: How long an already running worker may take to answer ``status()`` when re-attaching.
PREEXISTING_STATUS_TIMEOUT_S = 30.0


def _ray():
    import ray

    return ray


def _timed(timer: Any, label: str):
    """``timer.time(label)`` when a NeMo-RL-style timer is given, else a null context."""
    if timer is not None and hasattr(timer, "time"):
        return timer.time(label)
    return contextlib.nullcontext()


class Policy(PolicyRefitMethods, PolicyLifecycleMethods, PolicyCheckpointMethods):
    """Data-parallel HF policy on persistent Ray actors (see the module docstring).

    Args (seed signature, plus keyword-only extensions):
        cluster: a :class:`~nrl_tasks.distributed.virtual_cluster.RayVirtualCluster`; one
            worker per bundle (or ``workers_per_node`` per node entry).
        config: :class:`~nrl_tasks.models.policy.PolicyConfig` or its dict form.
        tokenizer: the HF tokenizer (shipped to the workers for ``generate`` and checkpoints).
        init_optimizer / init_reference_model: build AdamW+scheduler / keep the initial weights.
        weights_path / optimizer_path: a checkpoint (``save_checkpoint`` dirs) applied when the
            workers are set up; not re-applied when attaching to running workers (use
            ``load_checkpoint``).
        processor: multimodal processors are not supported (must be ``None``).
        worker_extension_cls_fqn: ``"pkg.mod.Class"`` mixed into the worker class; its methods
            are reachable with ``run_all_workers_*_data``.
        skip_weight_load: build the model from its config (random init) instead of loading
            weights (use with ``weights_path`` or ``load_checkpoint``).
        namespace: Ray namespace of the actors (default: the cluster's).
        detached: detached actors (persist across driver processes; default True).
        setup_timeout_s: limit for starting the actors and loading the model.
    """

    def __init__(
        self,
        cluster: Any,
        config: PolicyConfig | dict[str, Any],
        tokenizer: Any,
        name_prefix: str = "lm_policy",
        workers_per_node: Optional[Union[int, list[int]]] = None,
        init_optimizer: bool = True,
        weights_path: Optional[PathLike] = None,
        optimizer_path: Optional[PathLike] = None,
        init_reference_model: bool = True,
        processor: Any = None,
        worker_extension_cls_fqn: Optional[str] = None,
        skip_weight_load: bool = False,
        *,
        namespace: str | None = None,
        detached: bool = True,
        setup_timeout_s: float = 600.0,
    ) -> None:
        self._group: RayWorkerGroup | None = None
        self._created = False
        cfg = config if isinstance(config, PolicyConfig) else PolicyConfig.model_validate(config)
        if processor is not None:
            raise ValueError("processor: multimodal processors are not supported by this Policy")
        if not os.path.isdir(cfg.model_name):
            raise ValueError(f"model_name {cfg.model_name!r} is not a local directory (nothing is downloaded)")
        for label, path in (("weights_path", weights_path), ("optimizer_path", optimizer_path)):
            if path is not None and not os.path.isdir(os.fspath(path)):
                raise ValueError(f"{label} {os.fspath(path)!r} is not a directory")
        ray = _ray()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.name_prefix = name_prefix
        self.namespace = namespace or getattr(cluster, "namespace", None) or ray.get_runtime_context().namespace
        self.cluster = cluster
        self.detached = detached
        self.last_sharded_payload: dict[str, Any] | None = None
        self._weights_version = 0

        worker_cls = worker_class(worker_extension_cls_fqn)
        actor_kwargs = dict(
            config=cfg.model_dump(mode="json"),
            tokenizer=tokenizer,
            init_optimizer=init_optimizer,
            init_reference_model=init_reference_model,
            weights_path=os.fspath(weights_path) if weights_path is not None else None,
            optimizer_path=os.fspath(optimizer_path) if optimizer_path is not None else None,
            skip_weight_load=skip_weight_load,
        )
        group_kwargs = dict(
            name_prefix=name_prefix,
            namespace=self.namespace,
            actor_kwargs=actor_kwargs,
            env_vars=worker_env(cfg),
            detached=detached,
            num_cpus_per_worker=cfg.num_cpus_per_worker,
            bundle_indices=bundle_indices(cluster, workers_per_node),
        )
        group = RayWorkerGroup(cluster, worker_cls, **group_kwargs)
        mixed = any(group.preexisting) and not all(group.preexisting)  # some rank died
        statuses = None if mixed else self._statuses(group, setup_timeout_s)
        if statuses is not None and all(s["ready"] for s in statuses):
            self._check_attach(statuses, group.world_size)
            self._group = group
            self._weights_version = int(statuses[0]["weights_version"])
            logger.info("Policy %r: attached to %d running workers", name_prefix, group.world_size)
            return
        if statuses is None or any(s["ready"] for s in statuses):
            logger.warning("Policy %r: workers half alive or unresponsive; re-creating all of them", name_prefix)
            group.shutdown(force=True)
            group = RayWorkerGroup(cluster, worker_cls, **group_kwargs)
        self._group = group
        self._created = True
        try:
            ip, port = ray.get(group.workers[0].get_free_address.remote(), timeout=setup_timeout_s)
            done = ray.get(group.run_all_workers_single_data("setup", ip, port), timeout=setup_timeout_s)
        except BaseException:
            group.shutdown(force=True)
            self._group = None
            raise
        self._weights_version = int(done[0]["weights_version"])

    # ---------------------------------------------------------------------- attach
    @staticmethod
    def _statuses(group: RayWorkerGroup, timeout_s: float) -> list[dict[str, Any]] | None:
        """Every worker's ``status()``; ``None`` if one is dead or does not answer in time.

        Workers that existed before (re-attach) get ``PREEXISTING_STATUS_TIMEOUT_S``: a live
        worker answers at once unless it is stuck (e.g. in a collective with a dead peer).
        New workers get ``timeout_s`` (process start and imports).
        """
        ray = _ray()
        refs = group.run_all_workers_single_data("status")
        out = []
        try:
            for ref, old in zip(refs, group.preexisting):
                limit = min(timeout_s, PREEXISTING_STATUS_TIMEOUT_S) if old else timeout_s
                out.append(ray.get(ref, timeout=limit))
        except Exception as exc:  # noqa: BLE001 - dead or stuck actors are re-created
            logger.warning("Policy workers did not answer status(): %s", exc)
            return None
        return out

    def _check_attach(self, statuses: list[dict[str, Any]], world_size: int) -> None:
        running = PolicyConfig.model_validate(statuses[0]["config"])
        if running.config_hash() != self.cfg.config_hash():
            raise ValueError(
                f"Policy {self.name_prefix!r} in namespace {self.namespace!r} already runs with a different "
                f"config (differing keys: {self.cfg.diff(running)}); shut it down first or attach with its config"
            )
        sizes = {s["world_size"] for s in statuses}
        if sizes != {world_size}:
            raise ValueError(f"running workers report world sizes {sorted(sizes)}, expected {world_size}")

    @classmethod
    def attach(
        cls,
        config: PolicyConfig | dict[str, Any] | None,
        tokenizer: Any,
        *,
        name_prefix: str = "lm_policy",
        namespace: str,
        timeout_s: float = 60.0,
    ) -> "Policy":
        """Attach to a running Policy by name (from any process connected to its Ray cluster).

        ``config=None`` adopts the running config; otherwise it must equal it (``ValueError``
        naming the differing keys). Raises ``LookupError`` if an actor does not exist and
        ``RuntimeError`` if they exist but a rank is dead, unreachable or not set up.
        """
        ray = _ray()
        group = RayWorkerGroup.attach(name_prefix, namespace)
        try:
            statuses = ray.get(group.run_all_workers_single_data("status"), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - a dead or unreachable rank
            raise RuntimeError(f"Policy {name_prefix!r} in {namespace!r} is not healthy: {exc}") from exc
        not_ready = [s["rank"] for s in statuses if not s["ready"]]
        if not_ready:
            raise RuntimeError(f"Policy {name_prefix!r} in {namespace!r}: ranks {not_ready} are not set up")
        running = PolicyConfig.model_validate(statuses[0]["config"])
        self = cls.__new__(cls)
        self._group = None
        self._created = False
        self.cfg = running if config is None else (
            config if isinstance(config, PolicyConfig) else PolicyConfig.model_validate(config)
        )
        self.tokenizer = tokenizer
        self.name_prefix = name_prefix
        self.namespace = namespace
        self.cluster = None
        self.detached = True
        self.last_sharded_payload = None
        self._check_attach(statuses, group.world_size)
        self._group = group
        self._weights_version = int(statuses[0]["weights_version"])
        return self

    # ------------------------------------------------------------------ properties
    @property
    def worker_group(self) -> RayWorkerGroup:
        if self._group is None:
            raise RuntimeError(f"Policy {self.name_prefix!r} has been shut down")
        return self._group

    @property
    def data_parallel_size(self) -> int:
        """Number of data-parallel ranks (= workers)."""
        return self.worker_group.world_size

    @property
    def layout(self) -> Any:
        """How the workers lay out the model (:class:`~nrl_tasks.models.policy.workers.parallel.Layout`):
        plain, FSDP2-replicated or FSDP2-sharded."""

        return layout_for(self.cfg.dtensor_cfg, self.data_parallel_size, reward_model=self.cfg.reward_model_cfg.enabled)

    @property
    def weights_version(self) -> int:
        """Version of the live weights: 0 initially, +1 per non-eval ``train`` call."""
        return self._weights_version

    def set_weights_version(self, version: int) -> None:
        """Set the version on every worker (e.g. after restoring a checkpoint)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weights version must be an int >= 0, got {version!r}")
        self._get(self.worker_group.run_all_workers_single_data("set_weights_version", version))
        self._weights_version = version

    def refresh_weights_version(self) -> int:
        """Re-read the version from rank 0 (another process may have trained)."""
        self._weights_version = int(self._get(self.worker_group.run_single_worker(0, "get_weights_version")))
        return self._weights_version

    def worker_status(self) -> list[dict[str, Any]]:
        """Per rank: ``ready``, ``busy`` (the call in progress, or None), ``weights_version``,
        ``weights_valid`` (False after a train step left non-finite or partial weights, until a
        checkpoint is loaded: see ``NonFiniteTrainingError``), ``pid``, ``config_hash``. Answered
        by a control thread, so it returns during a long call."""
        return self._get(self.worker_group.run_all_workers_single_data("status"))

    @staticmethod
    def _get(refs: Any) -> Any:
        """``ray.get`` that raises as soon as any worker failed (a dead rank must not leave the
        caller waiting on a peer blocked in a collective)."""
        ray = _ray()
        if not isinstance(refs, list) or len(refs) < 2:
            return ray.get(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            ray.get(ready)
        return ray.get(refs)

    # ------------------------------------------------------------------ dispatch
    def run_all_workers_single_data(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method_name(*args, **kwargs)`` on every worker; returns their results."""
        return self._get(self.worker_group.run_all_workers_single_data(method_name, *args, **kwargs))

    def _all(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every worker; their results (raises as soon as one failed)."""
        return self._get(self.worker_group.run_all_workers_single_data(method, *args))

    def run_all_workers_multiple_data(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Each positional/keyword argument is a list with one entry per worker; returns results."""
        return self._get(self.worker_group.run_all_workers_multiple_data(method_name, *args, **kwargs))

    # ------------------------------------------------------------------ sharding
    def _shard_for_logprob(
        self, data: BatchedDataDict[Any]
    ) -> tuple[list[SlicedDataDict], Optional[list[int]]]:
        """Shard inputs for get_logprobs / get_reference_policy_logprobs: ``(shards,
        unsorted_data_indices)``, the inverse permutation being ``None`` unless dynamic batching
        or packing reordered rows (see :func:`~nrl_tasks.models.policy.workers.sharding.shard_for_logprob`)."""
        return sharding.shard_for_logprob(data, self.data_parallel_size, self.cfg)

    def _shard_for_train(self, data: BatchedDataDict[Any], batch_size: int) -> list[SlicedDataDict]:
        """Shard inputs for train: global batches of ``batch_size`` rows across the ranks, with
        ``train_mb_tokens`` plans; no reorder indices (train returns scalars)."""
        return sharding.shard_for_train(data, self.data_parallel_size, self.cfg, batch_size)

    def _report_sharded_payload(self, sharded_data: list[SlicedDataDict], boundary: str) -> None:
        """Measure the bytes each DP shard ships to its worker (stored in ``last_sharded_payload``)."""
        per_shard = [sum(sharding.payload_bytes(v) for v in shard.values()) for shard in sharded_data]
        self.last_sharded_payload = {"boundary": boundary, "bytes_per_shard": per_shard, "total_bytes": sum(per_shard)}
        logger.debug("Policy %s: shard payload bytes %s", boundary, per_shard)

    def _check_data(self, data: BatchedDataDict[Any], what: str) -> None:
        if not isinstance(data, BatchedDataDict):
            raise TypeError(f"{what}: data must be a BatchedDataDict, got {type(data).__name__}")
        for key in ("input_ids", "input_lengths"):
            if key not in data:
                raise ValueError(f"{what}: batch is missing key {key!r} (have {sorted(data.keys())})")
        width = data["input_ids"].shape[1] if data["input_ids"].ndim == 2 else None
        if width is None:
            raise ValueError(f"{what}: input_ids must be [B, S], got shape {tuple(data['input_ids'].shape)}")
        if width > self.cfg.max_total_sequence_length:
            raise ValueError(
                f"{what}: input_ids width {width} exceeds max_total_sequence_length "
                f"{self.cfg.max_total_sequence_length}"
            )

    def _sharded_call(self, method: str, data: BatchedDataDict[Any], *args: Any, **kwargs: Any) -> BatchedDataDict:
        shards, unsorted = self._shard_for_logprob(data)
        self._report_sharded_payload(shards, method)
        results = self._get(self.worker_group.run_all_workers_sharded_data(method, shards, *args, **kwargs))
        return sharding.merge_results(results, unsorted)

    # ------------------------------------------------------------------ inference
    def get_logprobs(
        self, data: BatchedDataDict[Any], timer: Any = None
    ) -> BatchedDataDict[Any]:
        """``{"logprobs": [B, S]}`` float32: position 0 is 0, position i is
        ``log p(token_i | tokens_<i)`` of ``logits / temperature``, padding 0."""
        self._check_data(data, "get_logprobs")
        with _timed(timer, "get_logprobs"):
            out = self._sharded_call("get_logprobs", data)
        return BatchedDataDict({"logprobs": out["logprobs"]})

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict[Any], micro_batch_size: Optional[int] = None, timer: Any = None
    ) -> BatchedDataDict[Any]:
        """``{"reference_logprobs": [B, S]}``: like ``get_logprobs`` with the initial weights."""
        self._check_data(data, "get_reference_policy_logprobs")
        with _timed(timer, "get_reference_policy_logprobs"):
            out = self._sharded_call("get_reference_policy_logprobs", data, micro_batch_size=micro_batch_size)
        return BatchedDataDict({"reference_logprobs": out["reference_logprobs"]})

    def get_topk_logits(
        self, data: BatchedDataDict[Any], k: int, micro_batch_size: Optional[int] = None, timer: Any = None
    ) -> BatchedDataDict[Any]:
        """``topk_logits [B, S, k]`` and ``topk_indices [B, S, k]`` (position t predicts t+1; padding 0)."""
        self._check_data(data, "get_topk_logits")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        dp = self.data_parallel_size
        shards = data.shard_by_batch_size(dp, allow_uneven_shards=data.size % dp != 0)
        self._report_sharded_payload(shards, "get_topk_logits")
        with _timed(timer, "get_topk_logits"):
            results = self._get(
                self.worker_group.run_all_workers_sharded_data("get_topk_logits", shards, k, micro_batch_size)
            )
        return BatchedDataDict.from_batches(results)

    def generate(self, data: BatchedDataDict[Any], greedy: bool = False) -> BatchedDataDict[Any]:
        """Sample continuations in the policy workers (colocated use), NeMo-RL output layout:
        ``output_ids``, ``logprobs``, ``generation_lengths``, ``unpadded_sequence_lengths``, ``truncated``."""
        self._check_data(data, "generate")
        if self.cfg.generation is None:
            raise ValueError("Policy.generate needs a 'generation' section in the policy config")
        dp = self.data_parallel_size
        shards = data.shard_by_batch_size(dp, allow_uneven_shards=data.size % dp != 0)
        self._report_sharded_payload(shards, "generate")
        results = self._get(self.worker_group.run_all_workers_sharded_data("generate", shards, greedy=greedy))
        results = [r for r in results if r.size] or results[:1]
        pad = self.cfg.generation.pad_token_id
        if pad is None and self.tokenizer is not None:
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        return BatchedDataDict.from_batches(results, pad_value_dict={"output_ids": int(pad or 0)})

    def score(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        """``{"scores": [B]}`` float32 from the sequence-classification head (``reward_model_cfg.enabled``)."""
        self._check_data(data, "score")
        if not self.cfg.reward_model_cfg.enabled:
            raise ValueError("Policy.score needs reward_model_cfg.enabled (a sequence-classification model)")
        dp = self.data_parallel_size
        shards = data.shard_by_batch_size(dp, allow_uneven_shards=data.size % dp != 0)
        self._report_sharded_payload(shards, "score")
        results = self._get(self.worker_group.run_all_workers_sharded_data("score", shards))
        return BatchedDataDict.from_batches(results)

    def get_values(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        """``{"values": [B, S]}`` float32 from a value model's head (PPO; ``reward_model_cfg.enabled``)."""
        self._check_data(data, "get_values")
        dp = self.data_parallel_size
        shards = data.shard_by_batch_size(dp, allow_uneven_shards=data.size % dp != 0)
        return BatchedDataDict.from_batches(self._get(self.worker_group.run_all_workers_sharded_data("get_values", shards)))

    # ------------------------------------------------------------------ training
    def train(
        self,
        data: BatchedDataDict[Any],
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: Optional[int] = None,
        mbs: Optional[int] = None,
        timer: Any = None,
        check_dim_skip_keys: Optional[Iterable[str]] = None,
    ) -> dict[str, Any]:
        """Train (or evaluate) on ``data``: one optimizer step per ``gbs`` rows.

        Returns ``loss`` (mean over global batches of the global-batch loss), ``grad_norm``
        (mean of the pre-clip norms), per-step ``losses`` / ``grad_norms`` / ``lr``,
        ``all_mb_metrics`` (metric -> values of every micro-batch of every rank),
        ``num_valid_tokens``, ``global_valid_seqs``, ``num_global_batches``, ``weights_version``.
        ``check_dim_skip_keys`` is accepted for NeMo-RL compatibility and ignored.
        """
        self._check_data(data, "train")
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        dp = self.data_parallel_size
        if data.size == 0 or data.size % gbs:
            raise ValueError(f"train: batch of {data.size} rows is not a positive multiple of gbs {gbs}")
        packing = self.cfg.sequence_packing.enabled or self.cfg.dynamic_batching.enabled
        if not packing:
            if gbs % dp:
                raise ValueError(f"train: gbs {gbs} is not a multiple of the data-parallel size {dp}")
            if (gbs // dp) % mbs:
                raise ValueError(f"train: per-rank batch {gbs // dp} (gbs {gbs} / dp {dp}) is not a multiple of mbs {mbs}")
        with _timed(timer, "train"):
            shards = self._shard_for_train(data, gbs)
            self._report_sharded_payload(shards, "train")
            results = self._get(
                self.worker_group.run_all_workers_sharded_data(
                    "train", shards, loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs
                )
            )
        first = results[0]
        metrics: dict[str, list[Any]] = {}
        for r in results:
            for key, values in r["all_mb_metrics"].items():
                metrics.setdefault(key, []).extend(values)
        losses, norms = first["global_loss"], first["grad_norm"]
        self._weights_version = int(first["weights_version"])
        return {
            "loss": float(sum(losses) / len(losses)),
            "grad_norm": float(sum(norms) / len(norms)),
            "losses": list(losses),
            "grad_norms": list(norms),
            "lr": first["lr"][-1] if first["lr"] else 0.0,
            "all_mb_metrics": metrics,
            "num_valid_tokens": float(sum(first["global_valid_toks"])),
            "global_valid_seqs": float(sum(first["global_valid_seqs"])),
            "num_global_batches": len(losses),
            "num_microbatches": [r["num_microbatches"] for r in results],
            "weights_version": self._weights_version,
            "train_time_s": max(r["train_time_s"] for r in results),
            # parameters + gradients + optimizer state held by rank 0 at the end of the call
            "policy_state_mb_per_rank": float(first["state_mb"]),
        }

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> bool:
        """Kill the worker actors (from any process holding a handle). Idempotent.

        The cluster's placement groups are left alone: they belong to the cluster, which other
        worker groups (e.g. colocated generation) may share; call ``cluster.shutdown()``.
        """
        group, self._group = self._group, None
        if group is None:
            return False
        return group.shutdown(force=False)

    def __del__(self) -> None:
        """Best effort, never raises: shuts down only non-detached actors this object created."""
        try:
            if getattr(self, "_created", False) and not getattr(self, "detached", True) and self._group is not None:
                self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown, Ray gone, ...
            pass

    def __repr__(self) -> str:
        size = self._group.world_size if self._group is not None else 0
        return f"Policy({self.name_prefix!r}, namespace={self.namespace!r}, dp={size}, version={self._weights_version})"
