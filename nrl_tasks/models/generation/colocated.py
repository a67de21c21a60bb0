"""Colocated generation: sampling inside the policy workers, on their live weights.

``generation.colocated.enabled: true`` is NeMo-RL's colocated mode: generation and training
share the same devices, one phase after the other, so one GPU runs a whole job. With the ``hf``
backend the policy workers already hold an HF model, so generation runs there
(``Policy.generate``: the call the HF generation workers make,
:func:`~nrl_tasks.models.generation.hf_sampling.sample_rows`, on the policy's rows of the batch
and, when sharded, on weights gathered once per call): no second copy of the model, no
generation actors, no weight transfer.

A refit of a shared model has nothing to move, so it *records the version* the generation side
serves (:meth:`ColocatedGeneration.record_refit`); the refit stage's contract is unchanged.
``generate(..., weights_version=v)`` runs only when the recorded version is ``v``, nothing marked
it stale since, and the policy's live weights are still that version: after ``train`` and before
the next refit, sampling on the newer weights is refused (``StaleWeightsError``) as a stale
generation worker would refuse it.

Deviations from NeMo-RL: the vLLM backend is not colocated (NeMo-RL sleeps the vLLM engine
during training and refits it over CUDA IPC handles; that needs a GPU and is not built), and the
sampling runs in the policy's precision (``policy.precision``), not ``generation.precision``.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from nrl_tasks.models.generation.interfaces import GenerationInterface, StaleWeightsError, require_prompts

__all__ = ["ColocatedGeneration", "SamplingPolicy"]


class SamplingPolicy(Protocol):
    """What colocated generation needs of a policy (``nrl_tasks.models.policy.lm_policy.Policy``)."""

    @property
    def weights_version(self) -> int: ...

    @property
    def worker_group(self) -> Any: ...

    def generate(self, data: Any, greedy: bool = False) -> Any: ...

    def weights_checksum(self) -> str: ...


class ColocatedGeneration(GenerationInterface):
    """The generation side of a colocated run: the policy's workers sample, this object keeps the
    version they serve (state of the flow's process, like the driver handle of a worker group: a
    new one starts at version 0, as fresh generation workers do)."""

    shares_policy_weights = True

    def __init__(self, policy: SamplingPolicy) -> None:
        self.policy = policy
        self._version = 0
        self._stale = False

    # ---------------------------------------------------------------- properties
    @property
    def workers(self) -> list[Any]:
        """The policy's workers: they do the sampling."""
        return list(self.policy.worker_group.workers)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def refit_world_size(self) -> int:
        """Ranks this side adds to a refit broadcast: none (nothing is sent)."""
        return 0

    # ---------------------------------------------------------------- generate
    def generate(self, data: Any, greedy: bool = False, *, weights_version: int | None = None) -> Any:
        """Sample on the policy's workers; ``StaleWeightsError`` unless they serve ``weights_version``."""
        require_prompts(data)
        self._check_version(weights_version)
        return self.policy.generate(data, greedy=greedy)

    def _check_version(self, weights_version: int | None) -> None:
        if self._stale:
            raise StaleWeightsError(
                f"colocated generation is stale (refit in progress or failed; last recorded version {self._version}); "
                f"asked for version {weights_version}"
            )
        if weights_version is not None and int(weights_version) != self._version:
            raise StaleWeightsError(
                f"colocated generation serves weights version {self._version}, asked for version {weights_version}"
            )
        live = self.policy.weights_version
        if live != self._version:
            raise StaleWeightsError(
                f"colocated generation serves version {self._version} but the policy's live weights are version {live} "
                "(trained since, no refit recorded)"
            )

    # ---------------------------------------------------------------- refit
    def record_refit(self, weights_version: int) -> dict[str, Any]:
        """The refit of a shared model: serve ``weights_version``, which the policy must hold."""
        start = time.perf_counter()
        live = self.policy.weights_version
        if live != int(weights_version):
            self._stale = True
            raise StaleWeightsError(f"colocated refit to version {weights_version}: the policy holds {live}")
        self._version, self._stale = int(weights_version), False
        return {"weights_version": self._version, "seconds": time.perf_counter() - start, "bytes": 0, "colocated": True}

    def prepare_refit_info(self, info_dict: dict[str, Any]) -> None:
        """Nothing to check: generation runs on the producer's own model."""

    def init_collective(self, ip: str, port: int, world_size: int, *, rank_offset: int, timeout_s: float | None = None) -> list[Any]:
        return []

    def update_weights_from_collective(self, weights_version: int) -> list[Any]:
        """No broadcast to consume: records ``weights_version`` (see :meth:`record_refit`)."""
        self.record_refit(weights_version)
        return []

    def teardown_collective(self) -> None:
        pass

    # ---------------------------------------------------------------- versions
    def weights_state(self) -> list[dict[str, Any]]:
        """One entry ``{"weights_version", "stale", "rank": 0}`` (the shape worker groups report)."""
        return [{"weights_version": self._version, "stale": self._stale, "rank": 0}]

    @property
    def weights_version(self) -> int | None:
        return None if self._stale else self._version

    def set_weights_version(self, weights_version: int) -> None:
        self._version = int(weights_version)

    def mark_stale(self) -> None:
        self._stale = True

    def weights_checksum(self) -> str:
        """The policy's checksum (the weights generation runs on)."""
        return self.policy.weights_checksum()

    def shutdown(self) -> None:
        """Nothing to stop: the policy owns the workers."""
