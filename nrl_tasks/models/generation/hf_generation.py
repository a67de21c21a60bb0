"""Generation worker groups: named, detached Ray actors that generate and receive refits.

:class:`RayGenerationGroup` implements :class:`GenerationInterface` over a
:class:`~nrl_tasks.distributed.worker_groups.RayWorkerGroup` of worker actors (actors
``f"{name_prefix}-{rank}"`` in ``namespace``); :class:`HfGeneration` is the ``hf`` backend
(:class:`~nrl_tasks.models.generation.hf_worker.HfGenerationWorker`), and
:class:`~nrl_tasks.models.generation.vllm_generation.VllmGeneration` the ``vllm`` one.

``generate`` splits the batch into contiguous shards, as even as possible (worker ``i`` gets
rows ``[start_i, end_i)``; fewer rows than workers leave the last workers idle), and
concatenates the results in order, right-padding ``output_ids`` with the pad id and
``logprobs`` with 0 to the widest shard. Errors raised inside a worker (``StaleWeightsError``,
``RefitMismatchError``, ``ValueError``) are re-raised here as themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.distributed.worker_groups import RayWorkerGroup
from nrl_tasks.models.generation.hf_worker import HfGenerationWorker
from nrl_tasks.models.generation.interfaces import GenerationConfig, GenerationInterface, require_prompts

__all__ = ["HfGeneration", "RayGenerationGroup", "concat_generation_outputs", "contiguous_bounds"]

_SHARDED_TENSOR_KEYS = ("input_ids", "input_lengths", "seeds")
_READY_TIMEOUT_S = 600.0


def contiguous_bounds(batch: int, shards: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of ``min(batch, shards)`` contiguous shards whose sizes differ by at most 1.

    >>> contiguous_bounds(5, 2)
    [(0, 3), (3, 5)]
    >>> contiguous_bounds(1, 3)
    [(0, 1)]
    """
    n = max(1, min(batch, shards))
    base, extra = divmod(batch, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def concat_generation_outputs(parts: list[Mapping[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Concatenate per-shard outputs along the batch, right-padding to the widest shard."""
    if not parts:
        raise ValueError("concat_generation_outputs: no parts")
    width = max(int(p["output_ids"].shape[1]) for p in parts)
    out: dict[str, list[torch.Tensor]] = {k: [] for k in parts[0]}
    for p in parts:
        pad = width - int(p["output_ids"].shape[1])
        for k, v in p.items():
            if k == "output_ids" and pad:
                v = torch.nn.functional.pad(v, (0, pad), value=pad_token_id)
            elif k == "logprobs" and pad:
                v = torch.nn.functional.pad(v, (0, pad), value=0.0)
            out[k].append(v)
    return {k: torch.cat(v, dim=0) for k, v in out.items()}


def _raise_cause(err: BaseException) -> None:
    cause = getattr(err, "cause", None)
    if isinstance(cause, Exception):
        raise cause from err
    raise err


def _ray_get(refs: Any, timeout: float | None = None) -> Any:
    import ray

    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as err:
        _raise_cause(err)


class RayGenerationGroup(GenerationInterface):
    """A group of generation worker actors; subclasses set :attr:`worker_cls`.

    Args:
        cluster: a ``RayVirtualCluster`` whose bundles host the workers.
        config: :class:`GenerationConfig` or its dict.
        name_prefix: actors are ``f"{name_prefix}-{rank}"`` (contract: ``"generation"``).
        namespace: Ray namespace (convention ``f"nrl-{run_id}"``); default: the driver's.
        model_path: local HF folder; default ``config.model_name``.
        num_workers: default ``config.num_workers``.
    """

    worker_cls: type = object

    def __init__(
        self,
        cluster: Any,
        config: GenerationConfig | Mapping[str, Any],
        *,
        name_prefix: str = "generation",
        namespace: str | None = None,
        model_path: str | None = None,
        num_workers: int | None = None,
    ) -> None:
        cfg = config if isinstance(config, GenerationConfig) else GenerationConfig.model_validate(dict(config))
        self._check_backend(cfg)
        path = model_path or cfg.model_name
        if not path:
            raise ValueError(f"{type(self).__name__}: no model path (pass model_path or set config.model_name)")
        self.cfg = cfg
        self._wg = RayWorkerGroup(
            cluster,
            self.worker_cls,
            name_prefix=name_prefix,
            namespace=namespace,
            num_workers=num_workers or cfg.num_workers,
            actor_kwargs={"config": cfg.model_dump(), "model_path": path},
            env_vars=self._env_vars(cfg),
            num_cpus_per_worker=cfg.num_cpus_per_worker,
        )
        self._after_start()

    def _check_backend(self, cfg: GenerationConfig) -> None:
        pass

    @staticmethod
    def _env_vars(cfg: GenerationConfig) -> dict[str, str]:
        return {
            "OMP_NUM_THREADS": str(cfg.torch_num_threads),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }

    def _after_start(self) -> None:
        infos = _ray_get([w.ready.remote() for w in self._wg.workers], timeout=_READY_TIMEOUT_S)
        self._worker_info = infos
        self.pad_token_id = int(infos[0]["pad_token_id"])

    @classmethod
    def attach(cls, *, name_prefix: str = "generation", namespace: str) -> RayGenerationGroup:
        """Re-attach to a running group by name (another process); ``LookupError`` if missing."""

        self = cls.__new__(cls)
        self._wg = RayWorkerGroup.attach(name_prefix, namespace)
        self.cfg = GenerationConfig.model_validate(_ray_get(self._wg.workers[0].get_config.remote()))
        self._after_start()
        return self

    # ---------------------------------------------------------------- properties
    @property
    def workers(self) -> list[Any]:
        return self._wg.workers

    @property
    def world_size(self) -> int:
        return self._wg.world_size

    @property
    def worker_group(self) -> Any:
        return self._wg

    @property
    def refit_world_size(self) -> int:
        """Ranks this group adds to a refit broadcast group (one per worker process that loads weights)."""
        return self.world_size

    # ---------------------------------------------------------------- generate
    def generate(self, data: Any, greedy: bool = False, *, weights_version: int | None = None) -> Any:
        """Shard ``data`` contiguously over the workers, generate, concatenate in order.

        Returns a ``BatchedDataDict`` of :class:`GenerationOutputSpec`. Raises
        ``StaleWeightsError`` if any worker is stale or holds another version.
        """

        batch = require_prompts(data)
        stop_strings = data["stop_strings"] if "stop_strings" in data else None
        refs = []
        for rank, (start, end) in enumerate(contiguous_bounds(batch, self.world_size)):
            shard: dict[str, Any] = {
                k: data[k][start:end].clone() for k in _SHARDED_TENSOR_KEYS if k in data and data[k] is not None
            }
            if stop_strings is not None:
                shard["stop_strings"] = list(stop_strings[start:end])
            refs.append(self._wg.workers[rank].generate.remote(shard, greedy, weights_version=weights_version))
        parts = _ray_get(refs)
        return BatchedDataDict(concat_generation_outputs(parts, self.pad_token_id))

    # ---------------------------------------------------------------- refit
    def prepare_refit_info(self, info_dict: dict[str, Any]) -> None:
        """Every worker checks the producer's metadata/fingerprint; ``RefitMismatchError`` if not equal."""
        _ray_get(self._wg.run_all_workers_single_data("prepare_refit_info", info_dict))

    def init_collective(
        self, ip: str, port: int, world_size: int, *, rank_offset: int, timeout_s: float | None = None
    ) -> list[Any]:
        """Worker ``i`` joins the broadcast group as rank ``rank_offset + i``; returns ObjectRefs."""
        n = self.world_size
        return self._wg.run_all_workers_multiple_data(
            "init_collective",
            [ip] * n,
            [int(port)] * n,
            [int(world_size)] * n,
            [int(rank_offset) + i for i in range(n)],
            [timeout_s] * n,
        )

    def update_weights_from_collective(self, weights_version: int) -> list[Any]:
        """Every worker consumes the packed broadcast (src rank 0); returns ObjectRefs of stats."""
        return self._wg.run_all_workers_single_data("update_weights_from_collective", int(weights_version))

    def teardown_collective(self) -> None:
        """Close every worker's broadcast group (before re-creating it on a retry)."""
        _ray_get(self._wg.run_all_workers_single_data("teardown_collective"))

    # ---------------------------------------------------------------- versions
    def weights_state(self) -> list[dict[str, Any]]:
        """Per worker ``{"weights_version", "stale", "rank"}``."""
        return _ray_get(self._wg.run_all_workers_single_data("get_weights_state"))

    @property
    def weights_version(self) -> int | None:
        states = self.weights_state()
        versions = {s["weights_version"] for s in states}
        if any(s["stale"] for s in states) or len(versions) != 1:
            return None
        return versions.pop()

    def set_weights_version(self, weights_version: int) -> None:
        _ray_get(self._wg.run_all_workers_single_data("set_weights_version", int(weights_version)))

    def mark_stale(self) -> None:
        _ray_get(self._wg.run_all_workers_single_data("mark_stale"))

    def weights_checksum(self) -> str:
        """The workers' common checksum; ``RuntimeError`` if they differ."""
        sums = _ray_get(self._wg.run_all_workers_single_data("weights_checksum"))
        if len(set(sums)) != 1:
            raise RuntimeError(f"generation workers hold different weights: checksums {sums}")
        return sums[0]

    def shutdown(self) -> None:
        """Kill the workers (their names are free again when this returns)."""
        self._wg.shutdown()


class HfGeneration(RayGenerationGroup):
    """``hf`` backend: :class:`~nrl_tasks.models.generation.hf_worker.HfGenerationWorker` actors."""

    worker_cls = HfGenerationWorker

    def _check_backend(self, cfg: GenerationConfig) -> None:
        if cfg.backend != "hf":
            raise ValueError(f"HfGeneration needs config.backend='hf', got {cfg.backend!r}")
