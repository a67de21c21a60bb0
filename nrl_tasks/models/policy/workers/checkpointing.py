"""Checkpoint files of a policy worker: safetensors + JSON only (no pickle, no ``torch.save``).

Layout of ``optimizer_path`` (weights go to ``weights_path`` as an HF folder via
``save_pretrained``, which writes safetensors)::

    optimizer.safetensors    state.<param name>.<key> tensors (AdamW exp_avg, exp_avg_sq, step)
    optimizer.json           format, param names, param_groups (params as names), non-tensor
                             state, LR-scheduler state, weights_version, data-parallel size
    rng/rank_<r>.safetensors torch CPU (and CUDA) RNG state of DP rank r (uint8 tensors)
    rng/rank_<r>.json        python and numpy RNG states of DP rank r

Every directory is written to a sibling temp dir first and renamed into place
(:func:`write_dir_atomically`), so a reader never sees a half-written checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nrl_tasks.models.policy.workers.parallel import local_tensor, shard_like

__all__ = [
    "FORMAT",
    "by_index",
    "by_name",
    "load_hf_weights_into",
    "load_optimizer_state",
    "load_rng_files",
    "optimizer_state_to_files",
    "write_dir_atomically",
    "write_rng_files",
]

FORMAT = "nrl-policy-optimizer/1"


def _fsync_dir_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def write_dir_atomically(path: str, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_dir)`` then move ``tmp_dir`` to ``path`` (replacing an old ``path``).

    The temp dir is a sibling of ``path`` (same filesystem, so the rename is atomic). An old
    ``path`` is first renamed aside and removed only after the new one is in place.
    """
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        write(tmp)
        _fsync_dir_tree(tmp)
        old = None
        if os.path.exists(path):
            old = os.path.join(parent, f".{os.path.basename(path)}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- weights
def _read_safetensors_dir(path: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    if not os.path.isdir(path):
        raise ValueError(f"weights_path {path!r} is not a directory")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"weights_path {path!r} holds no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for key, value in load_file(file).items():
            if key in tensors:
                raise ValueError(f"tensor {key!r} appears in more than one file of {path!r} ({file})")
            tensors[key] = value
    return tensors, files


@torch.no_grad()
def load_hf_weights_into(model: torch.nn.Module, path: str) -> int:
    """Copy the safetensors weights of HF folder ``path`` into ``model``'s live tensors.

    Bit-exact when dtypes agree (cast otherwise). Tied tensors may be stored once. Raises
    ``ValueError`` naming a missing tensor or a shape mismatch. Returns tensors copied.
    """
    loaded, _files = _read_safetensors_dir(path)
    state = model.state_dict(keep_vars=True)
    by_storage: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_storage.setdefault(id(tensor), []).append(name)
    copied, done = 0, set()
    for name, tensor in state.items():
        if id(tensor) in done:
            continue
        aliases = by_storage[id(tensor)]
        source = next((loaded[a] for a in aliases if a in loaded), None)
        if source is None:
            raise ValueError(f"weights in {path!r} have no tensor {name!r} (nor its aliases {aliases[1:]})")
        if tuple(source.shape) != tuple(tensor.shape):
            raise ValueError(
                f"tensor {name!r} in {path!r} has shape {list(source.shape)}, the model expects {list(tensor.shape)}"
            )
        local_tensor(tensor).copy_(shard_like(source.to(dtype=tensor.dtype), tensor))
        done.add(id(tensor))
        copied += 1
    return copied


# --------------------------------------------------------------------------- optimizer
def _json_safe(value: Any, where: str) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"{where}: cannot store a {type(value).__name__} in JSON")


def by_index(state_dict: dict[str, Any] | None, param_names: list[str]) -> dict[str, Any] | None:
    """An optimizer state dict keyed by parameter name (``torch.distributed.checkpoint``'s form)
    keyed by index into ``param_names`` instead (``torch.optim``'s form); None stays None."""
    if state_dict is None:
        return None
    index = {name: i for i, name in enumerate(param_names)}
    try:
        return {
            "state": {index[name]: value for name, value in state_dict["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state_dict["param_groups"]],
        }
    except KeyError as exc:
        raise ValueError(f"optimizer state names parameter {exc.args[0]!r}, which the model does not train") from None


def by_name(state_dict: dict[str, Any], param_names: list[str]) -> dict[str, Any]:
    """The inverse of :func:`by_index`."""
    return {
        "state": {param_names[int(i)]: value for i, value in state_dict["state"].items()},
        "param_groups": [{**g, "params": [param_names[int(i)] for i in g["params"]]} for g in state_dict["param_groups"]],
    }


def optimizer_state_to_files(
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    scheduler: Any,
    out_dir: str,
    meta: dict[str, Any],
    *,
    state_dict: dict[str, Any] | None = None,
) -> None:
    """Write the optimizer (and scheduler) state as ``optimizer.safetensors`` + ``optimizer.json``.

    ``param_names[i]`` names the optimizer's i-th parameter (flattened over param groups).
    ``state_dict``: the whole state in ``torch.optim``'s form when the live optimizer holds
    shards (gathered by the caller); ``optimizer.state_dict()`` otherwise.
    """
    sd = optimizer.state_dict() if state_dict is None else state_dict
    tensors: dict[str, torch.Tensor] = {}
    other_state: dict[str, dict[str, Any]] = {}
    for index, entry in sd["state"].items():
        name = param_names[int(index)]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{name}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                other_state.setdefault(name, {})[key] = _json_safe(value, f"optimizer state {name}.{key}")
    groups = []
    for group in sd["param_groups"]:
        g = {k: _json_safe(v, f"param_group.{k}") for k, v in group.items() if k != "params"}
        g["params"] = [param_names[int(i)] for i in group["params"]]
        groups.append(g)
    document = {
        "format": FORMAT,
        "param_names": list(param_names),
        "param_groups": groups,
        "non_tensor_state": other_state,
        "scheduler": _json_safe(scheduler.state_dict(), "scheduler") if scheduler is not None else None,
        **{k: _json_safe(v, k) for k, v in meta.items()},
    }
    save_file(tensors, os.path.join(out_dir, "optimizer.safetensors"), metadata={"format": FORMAT})
    with open(os.path.join(out_dir, "optimizer.json"), "w") as fh:
        json.dump(document, fh, indent=1)


def read_optimizer_json(path: str) -> dict[str, Any]:
    file = os.path.join(path, "optimizer.json")
    if not os.path.isfile(file):
        raise ValueError(f"optimizer_path {path!r} has no optimizer.json")
    with open(file) as fh:
        document = json.load(fh)
    if document.get("format") != FORMAT:
        raise ValueError(f"{file}: unknown format {document.get('format')!r} (expected {FORMAT!r})")
    return document


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    scheduler: Any,
    path: str,
    *,
    apply: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Restore optimizer and scheduler state written by :func:`optimizer_state_to_files`.

    ``apply(state_dict)`` puts the whole state (``torch.optim``'s form) into the optimizer
    (default ``optimizer.load_state_dict``; a sharded optimizer keeps its slices).
    Raises ``ValueError`` naming the file and parameter when the checkpoint does not fit.
    Returns the JSON document (for ``weights_version`` and other metadata).
    """
    document = read_optimizer_json(path)
    tensor_file = os.path.join(path, "optimizer.safetensors")
    if not os.path.isfile(tensor_file):
        raise ValueError(f"optimizer_path {path!r} has no optimizer.safetensors")
    tensors = load_file(tensor_file)
    if list(document["param_names"]) != list(param_names):
        saved, live = list(document["param_names"]), list(param_names)
        first = next((i for i, (a, b) in enumerate(zip(saved, live)) if a != b), min(len(saved), len(live)))
        raise ValueError(
            f"{tensor_file}: optimizer parameters differ from the model's at #{first} "
            f"(checkpoint {saved[first] if first < len(saved) else None!r}, "
            f"model {live[first] if first < len(live) else None!r})"
        )
    index = {name: i for i, name in enumerate(param_names)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, rest = key.split(".", 1)
        name, field = rest.rsplit(".", 1)
        if name not in index:
            raise ValueError(f"{tensor_file}: state for unknown parameter {name!r}")
        state.setdefault(index[name], {})[field] = value
    for name, extra in document.get("non_tensor_state", {}).items():
        state.setdefault(index[name], {}).update(extra)
    groups = []
    for g in document["param_groups"]:
        group = dict(g)
        group["params"] = [index[n] for n in g["params"]]
        if "betas" in group and isinstance(group["betas"], list):
            group["betas"] = tuple(group["betas"])
        groups.append(group)
    live_groups = optimizer.state_dict()["param_groups"]
    if len(groups) != len(live_groups) or any(len(a["params"]) != len(b["params"]) for a, b in zip(groups, live_groups)):
        raise ValueError(f"{path}: param groups do not match the live optimizer's")
    (apply or optimizer.load_state_dict)({"state": state, "param_groups": groups})
    if scheduler is not None and document.get("scheduler") is not None:
        sched = dict(document["scheduler"])
        scheduler.load_state_dict(sched)
    return document


# --------------------------------------------------------------------------------- RNG
def write_rng_files(out_dir: str, rank: int, tensors: dict[str, torch.Tensor], json_state: dict[str, Any]) -> None:
    rng_dir = os.path.join(out_dir, "rng")
    os.makedirs(rng_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(rng_dir, f"rank_{rank:05d}.safetensors"))
    with open(os.path.join(rng_dir, f"rank_{rank:05d}.json"), "w") as fh:
        json.dump(json_state, fh)


def load_rng_files(path: str, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    base = os.path.join(path, "rng", f"rank_{rank:05d}")
    if not (os.path.isfile(base + ".safetensors") and os.path.isfile(base + ".json")):
        raise ValueError(f"checkpoint {path!r} has no RNG state for data-parallel rank {rank} ({base}.*)")
    with open(base + ".json") as fh:
        json_state = json.load(fh)
    return load_file(base + ".safetensors"), json_state
