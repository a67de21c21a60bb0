"""Adapters-only refits into the ``vllm`` backend, through vLLM's own LoRA support.

A LoRA policy's refit sends only ``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` of each
adapted module with the layout ``{"r", "alpha", "modules"}`` (:mod:`nrl_tasks.utils.refit`). vLLM
applies adapters it loads as a ``LoRARequest`` from a PEFT folder, not from tensors in memory, so:

1. the vLLM workers receive the adapter tensors over the packed broadcast as for full weights
   (same fingerprint, checksum and retry protocol) and tensor-parallel rank 0 writes them as a
   PEFT folder (:func:`write_adapter_folder`: ``adapter_model.safetensors`` under peft's
   ``base_model.model.`` names plus ``adapter_config.json``), complete or not at all;
2. the actor registers the folder with ``llm.llm_engine.add_lora`` under a new integer id per
   refit (vLLM caches adapters by id), drops the previous one, and passes the request with every
   ``generate``.

The engine must be built with LoRA on (``enable_lora``) and a ``max_lora_rank`` at least the
adapter's ``r``; vLLM allows only the ranks in ``vllm.config.lora.MaxLoRARanks``, so a rank in
between is rounded up (:func:`vllm_lora_rank`). The base weights stay as vLLM loaded them from the
model folder; vLLM adds ``alpha / r * B A x`` with its own LoRA kernels. This module imports
without vLLM or peft (the vLLM venv has no peft: the folder is written with ``safetensors``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["PEFT_PREFIX", "adapter_refit_metadata", "vllm_lora_rank", "write_adapter_folder"]

PEFT_PREFIX = "base_model.model."  # peft's prefix of every tensor name in a saved adapter


def vllm_lora_rank(r: int, allowed: Iterable[int]) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds an adapter of rank ``r``."""
    fits = sorted(a for a in allowed if a >= int(r))
    if not fits:
        raise ValueError(f"LoRA rank {r} is above the largest rank vLLM supports ({max(allowed)})")
    return fits[0]


def adapter_refit_metadata(
    model: torch.nn.Module, layout: dict[str, Any], dtype: torch.dtype
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``[(name, shape, dtype)]`` of an adapters-only refit of ``layout`` onto ``model`` (a meta
    HF model is enough): ``lora_A`` is ``[r, in_features]`` and ``lora_B`` ``[out_features, r]``,
    in the layout's module order, as the policy sends them. ``ValueError`` naming a module that is
    missing or not a linear layer."""
    r = int(layout["r"])
    out: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for name in layout["modules"]:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"adapter layout names module {name!r}, which this model lacks") from None
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"adapter layout names module {name!r}, a {type(module).__name__}, not a linear layer")
        out.append((f"{name}.lora_A.weight", (r, module.in_features), dtype))
        out.append((f"{name}.lora_B.weight", (module.out_features, r), dtype))
    return out


def write_adapter_folder(path: str, layout: dict[str, Any], tensors: dict[str, torch.Tensor], base_model: str) -> str:
    """Write ``tensors`` (refit names) as a PEFT LoRA folder at ``path``; returns ``path``.

    Written into ``<path>.partial`` and renamed, so a folder at ``path`` is always complete.
    ``FileExistsError`` if ``path`` exists (each refit writes a new folder).
    """
    from safetensors.torch import save_file

    if os.path.exists(path):
        raise FileExistsError(f"adapter folder {path} exists already")
    partial = path + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    save_file({PEFT_PREFIX + n: t.contiguous() for n, t in tensors.items()}, os.path.join(partial, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": int(layout["r"]), "lora_alpha": float(layout["alpha"]), "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(layout["modules"]), "fan_in_fan_out": False, "modules_to_save": None,
        "use_rslora": False, "use_dora": False,
    }
    with open(os.path.join(partial, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    os.rename(partial, path)
    return path
