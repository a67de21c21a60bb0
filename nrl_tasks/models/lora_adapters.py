"""LoRA adapters as the policy and the generation workers both see them (``peft``).

Adapters-only refit (every generation backend): the generation workers load the base weights once
and receive only :func:`adapter_named_tensors` (``<module>.lora_A.weight`` and
``<module>.lora_B.weight`` of each adapted module, in module order) with their layout
:func:`adapter_layout` (rank, alpha, modules). On the first such refit an HF generation worker puts
the same LoRA layers into its plain HF model with ``peft.inject_adapter_in_model``
(:func:`inject_adapters`) and then only copies adapter tensors. It runs the adapters unmerged, so
its forward is the policy's own arithmetic (``W x + scale * B A x``): greedy outputs equal the
policy's ``generate`` bit for bit in float32. A vLLM worker hands the adapters to vLLM's own LoRA
support (:mod:`nrl_tasks.models.generation.vllm_lora`). An adapter checkpoint folder loads as its
base with the adapter merged (:func:`load_adapter_model`).

The policy's side (wrapping, merged checkpoints, restore) is
:mod:`nrl_tasks.models.policy.workers.lora`; this module imports neither the policy nor generation.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "adapter_layout",
    "adapter_named_tensors",
    "inject_adapters",
    "is_adapter_dir",
    "load_adapter_model",
    "lora_layers",
]


def lora_layers(base: torch.nn.Module) -> dict[str, Any]:
    """The peft LoRA layers of ``base`` by module name, in module order."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}


def adapter_layout(hf_model: torch.nn.Module) -> dict[str, Any] | None:
    """``{"r", "alpha", "modules"}`` of the LoRA layers in ``hf_model`` (the base HF model of a
    peft model, or a generation worker's model after :func:`inject_adapters`), ``None`` without
    LoRA layers. One rank and alpha for all modules (what ``LoRAConfig`` builds)."""
    layers = lora_layers(hf_model)
    if not layers:
        return None
    ranks = {layer.r[a] for layer in layers.values() for a in layer.active_adapters}
    alphas = {float(layer.lora_alpha[a]) for layer in layers.values() for a in layer.active_adapters}
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"LoRA layers with mixed ranks {sorted(ranks)} or alphas {sorted(alphas)}: no single adapter layout")
    return {"r": int(ranks.pop()), "alpha": alphas.pop(), "modules": list(layers)}


def adapter_named_tensors(hf_model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(<module>.lora_A.weight, A)`` and ``(<module>.lora_B.weight, B)`` of each LoRA layer of
    ``hf_model`` in module order: what an adapters-only refit sends (the live tensors)."""
    for name, layer in lora_layers(hf_model).items():
        for adapter in layer.active_adapters:
            yield f"{name}.lora_A.weight", layer.lora_A[adapter].weight.detach()
            yield f"{name}.lora_B.weight", layer.lora_B[adapter].weight.detach()


def inject_adapters(hf_model: torch.nn.Module, layout: dict[str, Any], dtype: torch.dtype) -> None:
    """Put LoRA layers of ``layout`` (:func:`adapter_layout`) into the plain HF ``hf_model`` in place
    (``peft.inject_adapter_in_model``; B = 0, so the model is unchanged until adapters arrive),
    adapter weights in ``dtype``, no dropout. ``ValueError`` naming a module the model lacks."""
    from peft import LoraConfig, inject_adapter_in_model

    names = {name for name, _ in hf_model.named_modules()}
    missing = [m for m in layout["modules"] if m not in names]
    if missing:
        raise ValueError(f"adapter layout names modules this model lacks: {missing[:3]}")
    cfg = LoraConfig(r=int(layout["r"]), lora_alpha=float(layout["alpha"]), lora_dropout=0.0,
                     target_modules=list(layout["modules"]), bias="none", init_lora_weights=True)
    inject_adapter_in_model(cfg, hf_model)
    for layer in lora_layers(hf_model).values():
        for part in (layer.lora_A, layer.lora_B):
            part.to(dtype)
        layer.requires_grad_(False)
    got = adapter_layout(hf_model)
    if got is None or got["modules"] != list(layout["modules"]):
        raise ValueError(f"injecting the adapter layout gave modules {None if got is None else got['modules'][:3]}, "
                         f"expected {list(layout['modules'])[:3]}")


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "adapter_config.json"))


def load_adapter_model(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """A plain HF model of a PEFT adapter folder: its base (``base_model_name_or_path`` of
    ``adapter_config.json``) with the adapter merged in. How generation workers and the eval sweep
    load an adapter checkpoint as it is, with no conversion step by the user."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as fh:
        base_path = json.load(fh).get("base_model_name_or_path")
    if not base_path or not os.path.isdir(base_path):
        raise ValueError(f"LoRA adapter {path!r}: its base model {base_path!r} (adapter_config.json) is not a local folder")
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    return PeftModel.from_pretrained(base, path).merge_and_unload()
