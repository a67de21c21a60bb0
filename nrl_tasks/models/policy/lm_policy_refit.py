"""The refit producer side of :class:`~nrl_tasks.models.policy.lm_policy.Policy`: refit metadata,
the broadcast group and the packed weight stream from rank 0 (seed 003 methods)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["PolicyRefitMethods"]


class PolicyRefitMethods:
    """Refit producer methods of ``Policy``.

    Mixed into :class:`~nrl_tasks.models.policy.lm_policy.Policy`; uses its ``worker_group``,
    ``_get`` (``ray.get`` failing fast) and ``_all`` (a call on every worker).
    """

    def prepare_refit_info(self) -> Optional[dict[str, Any]]:
        """``RefitInfo.to_dict()``: metadata, fingerprint, buffer size and weights version."""
        return self._get(self.worker_group.run_single_worker(0, "prepare_refit_info"))

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[Any]:
        """Policy rank 0 joins the refit broadcast group as its rank 0; returns ObjectRefs (one
        per rank: True for rank 0, False for the others). ``train_world_size`` is accepted for
        NeMo-RL compatibility; only rank 0 joins whatever the data-parallel size."""
        return self.worker_group.run_all_workers_single_data(
            "init_collective", ip, port, world_size, train_world_size=train_world_size
        )

    def broadcast_weights_for_collective(self, kv_scales: Optional[dict[str, float]] = None) -> list[Any]:
        """Rank 0 sends the weights with the packed producer; returns ObjectRefs."""
        return self.worker_group.run_all_workers_single_data("broadcast_weights_for_collective", kv_scales)

    def weights_checksum(self, as_sent: bool = True, algorithm: str | None = None) -> str:
        """Checksum of the refit tensors (``as_sent``: cast to the refit dtype) of rank 0 (every
        rank takes part when the weights are sharded); ``algorithm``: to compare with a recorded
        checksum, the one it was made with (:func:`nrl_tasks.utils.refit.checksum_algorithm`)."""
        return self._get(self.worker_group.run_all_workers_single_data("weights_checksum", as_sent, algorithm))[0]
