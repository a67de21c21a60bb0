"""Seeding and RNG state capture without pickle.

The torch CPU state (and each CUDA device's) is a ``uint8`` tensor stored in safetensors; the
Python ``random`` and NumPy MT19937 states are plain JSON. Restoring them gives bit-identical
subsequent draws.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state", "seed_everything", "configure_determinism"]


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python ``random`` and NumPy's global generator."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def configure_determinism(deterministic: bool, num_threads: int) -> None:
    """Fix the intra-op thread count and, if asked, prefer deterministic torch kernels.

    ``warn_only=True``: an op without a deterministic kernel warns instead of failing (on CPU
    the ops a causal LM uses are deterministic for a fixed thread count).
    """
    torch.set_num_threads(int(num_threads))
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if torch.cuda.is_available():
            torch.backends.cudnn.benchmark = False
            torch.backends.cudnn.deterministic = True


def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, json_state)``: torch CPU/CUDA states as tensors, python/numpy as JSON."""
    tensors = {"torch_cpu": torch.get_rng_state().clone()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state.clone()
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    json_state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    return tensors, json_state


def restore_rng_state(tensors: dict[str, torch.Tensor], json_state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`; ``ValueError`` naming a missing or bad entry."""
    if "torch_cpu" not in tensors:
        raise ValueError("RNG state is missing 'torch_cpu'")
    state = tensors["torch_cpu"]
    if state.dtype != torch.uint8 or state.ndim != 1:
        raise ValueError(f"RNG state 'torch_cpu' must be a 1-D uint8 tensor, got {state.dtype} {tuple(state.shape)}")
    for key in ("python", "numpy"):
        if key not in json_state:
            raise ValueError(f"RNG state is missing {key!r}")
    torch.set_rng_state(state.contiguous())
    if torch.cuda.is_available():
        cuda = [tensors[f"torch_cuda_{i}"] for i in range(torch.cuda.device_count()) if f"torch_cuda_{i}" in tensors]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = json_state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    kind, keys, pos, has_gauss, cached = json_state["numpy"]
    np.random.set_state((str(kind), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
