"""LoRA on the HF policy (``policy.dtensor_cfg.lora_cfg``), built with ``peft``.

The algorithm, when ``lora_cfg.enabled``:

1. build: the HF model (float32 master weights) is wrapped with ``peft.get_peft_model``
   (:func:`wrap_with_lora`); peft freezes every base parameter, so only the adapter matrices
   ``lora_A``/``lora_B`` require grad, and the worker's optimizer (built from the parameters
   that require grad) holds only them. B starts at zero: the wrapped model equals the base.
2. reference logprobs: the base model is the reference, so no copy of the initial weights is
   kept; the worker runs the forward inside ``model.disable_adapter()``.
3. merged weights (``save_merged`` checkpoints): :func:`merged_named_tensors` gives the state
   dict of the *base HF model*, with its original parameter names and order, where each adapted
   ``weight`` is a new tensor ``W + alpha/dim * B @ A`` (peft's ``get_delta_weight``). The live
   base weights are never touched: peft's ``merge_adapter``/``unmerge_adapter`` would do
   ``W += d; W -= d``, which does not give back ``W`` bit for bit in float32, so a merged *copy*
   is computed instead (same arithmetic as peft's merge, so the same bits as a merge).
4. checkpoints: ``weights/`` holds the adapter in peft's format (``adapter_config.json`` +
   ``adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained(base, path)``);
   with ``save_merged`` a sibling ``<weights>_merged/`` holds the merged HF safetensors.
   ``adapter_config.json`` is the same bytes in every process (:func:`sort_adapter_config`).
   A restore copies the adapter tensors into the live peft model (bit-exact).

5. adapters-only refit: the generation workers receive only the adapter tensors; what both
   sides share is in :mod:`nrl_tasks.models.lora_adapters`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from nrl_tasks.models.lora_adapters import (
    adapter_layout,
    adapter_named_tensors,
    inject_adapters,
    is_adapter_dir,
    load_adapter_model,
    lora_layers,
)
from nrl_tasks.models.policy.workers.parallel import full_tensor, like

__all__ = [
    "ADAPTER_FILE",
    "adapter_layout",
    "adapter_named_tensors",
    "check_lora_modules",
    "check_lora_targets",
    "inject_adapters",
    "is_adapter_dir",
    "load_adapter_into",
    "load_adapter_model",
    "merged_named_tensors",
    "merged_state",
    "merged_weights_path",
    "save_merged",
    "sort_adapter_config",
    "wrap_with_lora",
]

ADAPTER_FILE = "adapter_model.safetensors"
_KEY = "policy.dtensor_cfg.lora_cfg"


def merged_weights_path(weights_path: str) -> str:
    """Where ``save_merged`` writes the merged HF folder: ``<weights_path>_merged`` (a sibling)."""
    return weights_path.rstrip("/") + "_merged"


def _linear_names(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def _matches(module: str, names: list[str]) -> bool:
    """Whether ``module`` is one of ``names`` or ends with ``"." + name`` (as peft matches)."""
    return any(module == t or module.endswith("." + t) for t in names)


def _unknown(names: list[str], modules: list[str]) -> list[str]:
    """Entries of ``names`` that match no module (peft matches a name or a dotted suffix)."""
    return [t for t in names if not any(_matches(m, [t]) for m in modules)]


def check_lora_modules(model: torch.nn.Module, cfg: Any) -> None:
    """``ValueError`` naming the key unless every ``target_modules`` / ``exclude_modules`` entry of
    ``cfg`` (a ``LoRAConfig``) names a module of ``model`` (a name or a dotted suffix, as peft
    matches) and at least one module is left to adapt (``match_all_linear``: every linear layer but
    the output layer, as peft's ``"all-linear"``; else the targets), less the excluded ones."""
    all_modules = [name for name, _ in model.named_modules() if name]
    linear = _linear_names(model)
    short = sorted({n.rsplit(".", 1)[-1] for n in linear})
    for key, names in (("target_modules", cfg.target_modules), ("exclude_modules", cfg.exclude_modules)):
        unknown = _unknown(list(names), all_modules)
        if unknown:
            raise ValueError(f"{_KEY}.{key}: no module named {unknown} in the model (its linear modules: {short})")
    if cfg.match_all_linear:  # peft's "all-linear" leaves out the output layer
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        chosen = [n for n in linear if model.get_submodule(n) is not head]
    else:
        chosen = [m for m in all_modules if _matches(m, cfg.target_modules)]
    left = [m for m in chosen if not _matches(m, cfg.exclude_modules)]
    if not left:
        raise ValueError(
            f"{_KEY}.exclude_modules {list(cfg.exclude_modules)} excludes every module "
            f"{'of match_all_linear' if cfg.match_all_linear else 'of target_modules'}: nothing to adapt"
        )


def check_lora_targets(model_path: str, cfg: Any) -> None:
    """:func:`check_lora_modules` before anything starts: the model of ``model_path`` (an HF
    folder) is built from its ``config.json`` on the meta device (no weights read, no memory).
    A config transformers cannot read is left to the worker, which checks again."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - an unusual model folder: the worker's own check names the problem
        return
    check_lora_modules(model, cfg)


def wrap_with_lora(model: torch.nn.Module, cfg: Any) -> Any:
    """``peft.get_peft_model(model, ...)`` for ``cfg`` (a ``LoRAConfig``), after
    :func:`check_lora_modules` (a ``ValueError`` naming the key and the unknown names otherwise).
    With ``lora_A_init="xavier"`` every ``lora_A`` is redrawn with ``xavier_normal_`` (in module
    order, from torch's RNG)."""
    from peft import LoraConfig, get_peft_model

    check_lora_modules(model, cfg)
    peft_cfg = LoraConfig(
        r=cfg.dim,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules="all-linear" if cfg.match_all_linear else list(cfg.target_modules),
        exclude_modules=list(cfg.exclude_modules) or None,
        init_lora_weights=True,
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped = get_peft_model(model, peft_cfg)
    if cfg.lora_A_init == "xavier":
        with torch.no_grad():
            for name, param in wrapped.named_parameters():
                if ".lora_A." in name:
                    torch.nn.init.xavier_normal_(param)
    return wrapped


def merged_named_tensors(model: Any, *, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the base HF model's state dict with the HF names and order (peft's
    ``base_layer`` removed, adapter tensors left out, aliases once), each adapted ``weight`` as a
    new tensor ``W + scale * B @ A`` (``merge=False``: the base ``W`` itself, for shapes only).
    The live weights are not changed."""
    base = model.get_base_model()
    layers = lora_layers(base)
    seen: set[int] = set()
    for name, tensor in base.state_dict(keep_vars=True).items():
        parts = name.split(".")
        if any(p.startswith("lora_") for p in parts):
            continue
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if "base_layer" in parts:
            at = parts.index("base_layer")
            owner = ".".join(parts[:at])
            hf_name = ".".join(parts[:at] + parts[at + 1 :])
            layer = layers.get(owner)
            if merge and layer is not None and parts[at + 1 :] == ["weight"]:
                with torch.no_grad():
                    delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters)
                    yield hf_name, tensor.detach() + delta.to(tensor.dtype)
                continue
            yield hf_name, tensor.detach()
        else:
            yield name, tensor.detach()


def merged_state(model: Any) -> dict[str, torch.Tensor]:
    """The merged weights (:func:`merged_named_tensors`) as whole CPU tensors. With sharded
    (FSDP2) weights every rank must call it (each tensor is gathered in turn)."""

    return {n: full_tensor(t).to("cpu").contiguous() for n, t in merged_named_tensors(model)}


def save_merged(model: Any, path: str, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write the merged weights (``state``, else :func:`merged_state`) as an HF folder at ``path``
    that ``AutoModelForCausalLM.from_pretrained(path)`` loads without peft."""
    model.get_base_model().save_pretrained(path, state_dict=merged_state(model) if state is None else state)


def sort_adapter_config(model: Any, path: str) -> None:
    """Rewrite the ``adapter_config.json`` that ``model.save_pretrained(path)`` wrote (peft) with
    each field peft holds as a set (``target_modules``, ``exclude_modules``, ...) sorted.

    Why: peft writes ``list(set)``, whose order follows the process's string hash seed, so the
    adapter config of a resumed run differed byte-wise from the uninterrupted run's. Fields that
    are lists in peft's config keep their order; the file keeps peft's layout (``indent=2``,
    sorted keys)."""
    for name, config in model.peft_config.items():
        sets = [key for key, value in config.to_dict().items() if isinstance(value, set)]
        if not sets:
            continue
        file = os.path.join(path if name == "default" else os.path.join(path, name), "adapter_config.json")
        with open(file, encoding="utf-8") as fh:
            data = json.load(fh)
        for key in sets:
            data[key] = sorted(data[key])
        with open(file, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(data, indent=2, sort_keys=True))


@torch.no_grad()
def load_adapter_into(model: Any, path: str) -> int:
    """Copy the adapter tensors of peft folder ``path`` into the live peft ``model`` (bit-exact).
    ``ValueError`` naming the path and the first tensor when the adapter does not fit."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    file = os.path.join(path, ADAPTER_FILE)
    if not (is_adapter_dir(path) and os.path.isfile(file)):
        raise ValueError(
            f"weights_path {path!r} holds no LoRA adapter (adapter_config.json + {ADAPTER_FILE}); "
            f"{_KEY}.enabled expects one"
        )
    loaded = load_file(file)
    expected = get_peft_model_state_dict(model)
    missing, extra = sorted(set(expected) - set(loaded)), sorted(set(loaded) - set(expected))
    if missing or extra:
        raise ValueError(f"adapter in {path!r} does not fit this model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, tensor in loaded.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"adapter tensor {name!r} in {path!r} has shape {list(tensor.shape)}, "
                f"the model expects {list(expected[name].shape)}"
            )

    # sharded (FSDP2) adapters: each rank keeps its slices of the whole tensors read from the file
    result = set_peft_model_state_dict(model, {n: like(t, expected[n]) for n, t in loaded.items()})
    if result.unexpected_keys:
        raise ValueError(f"adapter in {path!r}: tensors not used by the model: {result.unexpected_keys[:3]}")
    return len(loaded)
