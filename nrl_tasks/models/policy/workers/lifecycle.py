"""Device placement and lifecycle methods of a policy worker (mixed into ``PolicyWorker``).

On a GPU worker the model lives on ``cuda``; ``offload_*`` move weights and optimizer state to
CPU and ``prepare_*`` move them back. On a CPU worker there is nothing to move: these methods
switch train/eval mode and free gradients (tensors are freed by reference counting; a full
``gc.collect()`` costs seconds in a process that imported torch and transformers, so it runs only
on GPU workers, before ``torch.cuda.empty_cache()``), as their docstrings say.
"""

from __future__ import annotations

import gc
import os
import time

import torch
import torch.distributed as dist

__all__ = ["LifecycleMixin"]


class LifecycleMixin:
    """Expects ``self.model``, ``self.optimizer``, ``self.device``, ``self.cfg``, ``self.rank``."""

    _profiler = None
    _offloaded = False

    def prepare_for_training(self) -> None:
        """GPU: move weights and optimizer state back to the device. CPU: train mode only."""
        self._require_ready()
        self._to_device()
        self.model.train()

    def prepare_for_lp_inference(self) -> None:
        """GPU: weights to the device; CPU: eval mode only."""
        self._require_ready()
        self._to_device()
        self.model.eval()

    def prepare_for_generation(self) -> bool:
        """Same as ``prepare_for_lp_inference`` (generation uses the live weights)."""
        self.prepare_for_lp_inference()
        return True

    def finish_generation(self) -> bool:
        """Nothing is cached between ``generate`` calls (the KV cache is per call)."""
        return True

    def invalidate_kv_cache(self) -> bool:
        """No persistent KV cache exists (each ``generate`` call builds its own): nothing to drop."""
        return True

    def finish_inference(self) -> None:
        """GPU: offload weights to CPU and empty the CUDA cache; CPU: nothing to do."""
        self.offload_to_cpu(optimizer=False)

    def finish_training(self) -> None:
        """Free gradients (``set_to_none``); on GPU also collect garbage and empty the CUDA cache."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        elif self.model is not None:
            self.model.zero_grad(set_to_none=True)
        self._collect()

    def offload_before_refit(self) -> None:
        """GPU: optimizer state to CPU (weights stay for the broadcast). CPU: free gradients."""
        self.finish_training()
        if self.device.type == "cuda" and self.optimizer is not None:
            _move_optimizer_state(self.optimizer, torch.device("cpu"))
            self._offloaded = True
        self._collect()

    def offload_after_refit(self) -> None:
        """GPU: weights and optimizer state to CPU (compute calls move them back). CPU: nothing to move."""
        self.offload_to_cpu(optimizer=True)

    def offload_to_cpu(self, optimizer: bool = True) -> None:
        """GPU: move weights (and optimizer state) to CPU. CPU: nothing to move."""
        if self.device.type == "cuda" and self.model is not None:
            self.model.to("cpu")
            if optimizer and self.optimizer is not None:
                _move_optimizer_state(self.optimizer, torch.device("cpu"))
            self._offloaded = True
        self._collect()

    def _to_device(self) -> None:
        if self._offloaded:
            self.model.to(self.device)
            if self.optimizer is not None:
                _move_optimizer_state(self.optimizer, self.device)
            self._offloaded = False

    def _collect(self) -> None:
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def get_free_memory_bytes(self) -> int:
        """Free device memory: ``cudaMemGetInfo`` on GPU, available system RAM on CPU (psutil,
        else ``MemAvailable`` of ``/proc/meminfo``)."""
        if self.device.type == "cuda":
            return int(torch.cuda.mem_get_info(self.device)[0])
        try:
            import psutil
        except ImportError:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
            raise RuntimeError("cannot read the available memory (no psutil, no /proc/meminfo)") from None
        return int(psutil.virtual_memory().available)

    def node_ip_and_gpu_id(self) -> tuple[str, int]:
        """``(node ip, GPU id)``; the GPU id is -1 on a CPU worker."""
        import ray

        gpu_ids = ray.get_gpu_ids()
        return ray.util.get_node_ip_address(), int(gpu_ids[0]) if gpu_ids else -1

    def start_gpu_profiling(self) -> None:
        """Start ``torch.profiler`` (CPU activities, plus CUDA on a GPU worker)."""
        if self._profiler is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=False)
        self._profiler.__enter__()

    def stop_gpu_profiling(self) -> str | None:
        """Stop profiling and write a Chrome trace; returns its path (None if not profiling)."""
        if self._profiler is None:
            return None
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        import tempfile

        out_dir = self.cfg.profiler_dir or os.path.join(tempfile.gettempdir(), "nrl-profiles")
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"policy_rank{self.rank}_{os.getpid()}_{int(time.time() * 1000)}.json")
        prof.export_chrome_trace(path)
        return path

    def shutdown(self) -> bool:
        """Leave the process groups (the actor is killed by the caller afterwards)."""
        self.close_refit_group()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - partner already gone
                pass
        return True




def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device)
