"""Device lifecycle, memory, profiling and placement queries of
:class:`~nrl_tasks.models.policy.lm_policy.Policy` (seed 003 methods). On CPU most lifecycle
calls only switch train/eval modes or free gradients; each docstring says what happens where."""

from __future__ import annotations

from typing import Any

__all__ = ["PolicyLifecycleMethods"]


class PolicyLifecycleMethods:
    """Lifecycle, memory, profiling and placement methods of ``Policy``.

    Mixed into :class:`~nrl_tasks.models.policy.lm_policy.Policy`; uses its ``worker_group``,
    ``_get`` (``ray.get`` failing fast) and ``_all`` (a call on every worker).
    """

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """GPU: weights back on the device; CPU: eval mode."""
        return all(self._all("prepare_for_generation"))

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """No generation state persists between calls (returns True)."""
        return all(self._all("finish_generation"))

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        """GPU: weights and optimizer state back on the device; CPU: train mode."""
        self._all("prepare_for_training")

    def prepare_for_lp_inference(self, *args: Any, **kwargs: Any) -> None:
        """GPU: weights on the device; CPU: eval mode."""
        self._all("prepare_for_lp_inference")

    def invalidate_kv_cache(self, *args: Any, **kwargs: Any) -> bool:
        """No persistent KV cache exists here (True)."""
        return all(self._all("invalidate_kv_cache"))

    def finish_inference(self) -> None:
        """GPU: offload weights to CPU; CPU: nothing to do."""
        self._all("finish_inference")

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        """Free gradients (GPU: also empty the CUDA cache)."""
        self._all("finish_training")

    def offload_before_refit(self) -> None:
        """GPU: optimizer state to CPU; CPU: free gradients."""
        self._all("offload_before_refit")

    def offload_after_refit(self) -> None:
        """GPU: weights and optimizer state to CPU; CPU: nothing to move."""
        self._all("offload_after_refit")

    def offload_to_cpu(self) -> None:
        """GPU: everything to CPU; CPU: nothing to move."""
        self._all("offload_to_cpu")

    def get_free_memory_bytes(self) -> int:
        """Smallest free memory over the workers (GPU memory, or system RAM on CPU)."""
        return int(min(self._all("get_free_memory_bytes")))

    def start_gpu_profiling(self) -> None:
        """Start ``torch.profiler`` in every worker (CPU activities, plus CUDA on GPUs)."""
        self._all("start_gpu_profiling")

    def stop_gpu_profiling(self) -> list[str]:
        """Stop profiling; each worker writes a Chrome trace. Returns the trace paths."""
        return [p for p in self._all("stop_gpu_profiling") if p]

    def print_node_ip_and_gpu_id(self) -> list[tuple[str, int]]:
        """Print and return ``(node ip, GPU id)`` per worker (GPU id -1 on CPU)."""
        out = [tuple(x) for x in self._all("node_ip_and_gpu_id")]
        for rank, (ip, gpu) in enumerate(out):
            print(f"policy worker {rank}: node {ip}, gpu {gpu}")
        return out
