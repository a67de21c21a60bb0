"""Torch's data parallelism for a policy worker: FSDP2 (``fully_shard``) over a ``DeviceMesh``.

How a model is laid out over the policy's ``W`` ranks (``policy.dtensor_cfg``, NeMo-RL's keys):

- ``enabled: true`` (the default, as in NeMo-RL): **sharded**. A 1-D mesh ``("dp_shard",)`` of
  the ``W`` ranks; ``fully_shard`` is applied to every decoder layer (the classes the HF model
  names in ``_no_split_modules``) and then to the root, so each rank holds ``1/W`` of every
  parameter (a ``DTensor`` sharded on dim 0), of its gradient and of the AdamW moments (the
  optimizer is built on the sharded parameters). A layer's full weights exist only while it runs
  (all-gathered before its forward and backward, freed after); gradients are reduce-scattered.
- ``enabled: false``: **replicated** (every rank a full copy), written with the same API: a 2-D
  mesh ``("dp_replicate", "dp_shard")`` of shape ``(W, 1)``, i.e. FSDP2's hybrid mode with shards
  of size 1, which is plain data parallelism: gradients are all-reduced over ``dp_replicate``.

Gradients are **summed**, not averaged, over ranks (``set_gradient_divide_factor(1.0)``): the
loss functions already normalise by the *global* number of valid tokens or sequences, so the sum
is the gradient of the global loss. Gloo has no ``PREMUL_SUM``, so reductions are forced to plain
sums (``set_force_sum_reduction_for_comms``). For a fixed number of ranks the reduction order is
fixed: results are deterministic, and a resume is bit-identical.

One rank and no ``cpu_offload``: nothing to shard or reduce, the model stays a plain module
(bit-identical to earlier releases). ``cpu_offload: true`` (sharded parameters, gradients and
optimizer state kept in CPU memory between uses, FSDP2's ``CPUOffloadPolicy``) wraps even one
rank. ``activation_checkpointing: true`` recomputes each decoder layer's activations in the
backward (HF's ``gradient_checkpointing_enable``, non-reentrant). Refused with a clear error:
``tensor_parallel_size``/``context_parallel_size`` > 1, ``sequence_parallel`` and
``custom_parallel_plan`` (see :class:`~nrl_tasks.models.policy.DTensorConfig`).

Every forward and backward of a wrapped model is a collective (all ranks take part), so a worker
runs the same number of forwards on every rank (:func:`lockstep_count`; a rank with fewer
micro-batches runs zero-weighted dummy ones) and never leaves a micro-batch loop early.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Layout",
    "full_tensor",
    "gathered_weights",
    "like",
    "layout_for",
    "local_tensor",
    "lockstep_count",
    "parallelize",
    "shard_like",
    "state_bytes",
]


@dataclass(frozen=True)
class Layout:
    """How the model of one worker is laid out: ``wrapped`` (FSDP2 applied), ``sharded`` (each
    rank holds a slice, so gathering a full tensor is a collective of all ranks), ``world_size``."""

    wrapped: bool
    sharded: bool
    world_size: int

    @property
    def mode(self) -> str:
        if not self.wrapped:
            return "single"
        if self.world_size == 1:
            return "fsdp2-one-rank"  # cpu_offload on a single rank
        return "fsdp2-sharded" if self.sharded else "fsdp2-replicated"


def layout_for(dtensor_cfg: Any, world_size: int, *, reward_model: bool = False) -> Layout:
    """The layout a worker with ``world_size`` ranks uses. A reward model (inference only) is
    never wrapped: each rank holds a full copy."""
    if reward_model:
        return Layout(False, False, world_size)
    wrapped = world_size > 1 or bool(dtensor_cfg.cpu_offload)
    return Layout(wrapped, wrapped and bool(dtensor_cfg.enabled) and world_size > 1, world_size)


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model itself (the base of a peft model)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _fsdp_units(model: torch.nn.Module) -> list[Any]:
    """The modules ``fully_shard`` was applied to, root first (module order)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 wraps one by one: instances of the classes HF names in
    ``_no_split_modules`` (the decoder layers), outermost first."""
    base = _hf_model(model)
    names = set(getattr(base, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(
            f"policy.dtensor_cfg: cannot find the decoder layers of {type(base).__name__} to shard "
            "(the model names no _no_split_modules)"
        )
    return [m for m in model.modules() if type(m).__name__ in names]


def parallelize(model: torch.nn.Module, dtensor_cfg: Any, layout: Layout, device: torch.device) -> torch.nn.Module:
    """Apply ``layout`` to ``model`` (in place; returns it). Needs the default process group of
    ``layout.world_size`` ranks when wrapping."""
    if dtensor_cfg.activation_checkpointing:
        _hf_model(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not layout.wrapped:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    world = layout.world_size
    if layout.sharded or world == 1:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    else:
        mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if dtensor_cfg.cpu_offload else OffloadPolicy()
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, offload_policy=offload)
    # the root too frees its gathered weights after each forward: parameters are always at rest
    # (sharded DTensors) between calls, so they can be read and written outside a forward
    fully_shard(model, mesh=mesh, offload_policy=offload, reshard_after_forward=True)
    for unit in _fsdp_units(model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return model


@contextlib.contextmanager
def gathered_weights(model: torch.nn.Module, layout: Layout) -> Iterator[None]:
    """Hold the whole weights on this rank for a while (sampling): every FSDP2 unit is
    all-gathered once (a collective, the same units in the same order on every rank) and kept
    unsharded, so the forwards inside run without collectives and ranks may run different numbers
    of them; sharded again on exit. Nothing to do for a plain or replicated model."""
    if not layout.sharded:
        yield
        return
    units = _fsdp_units(model)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (``t`` itself for a plain tensor); writes to it write the parameter."""
    return t.to_local() if _is_dtensor(t) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t``: a collective of all ranks when ``t`` is sharded (every rank must call
    it, in the same order); no communication for a plain or replicated tensor."""
    if not _is_dtensor(t):
        return t
    if all(p.is_replicate() or t.device_mesh.size(i) == 1 for i, p in enumerate(t.placements)):
        return t.to_local()
    return t.full_tensor()


def shard_like(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The part of the whole tensor ``full`` that this rank holds of ``target`` (no communication:
    every rank slices its own copy)."""
    if not _is_dtensor(target):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()


def like(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``target`` (a ``DTensor`` holding this rank's part when ``target`` is
    one; ``full`` itself otherwise), for ``load_state_dict`` into a wrapped model."""
    if not _is_dtensor(target):
        return full
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(shard_like(full, target), target.device_mesh, target.placements,
                              shape=target.shape, stride=target.stride())


def state_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds (local parts only)."""
    total = 0
    for p in params:
        total += local_tensor(p).numel() * p.element_size()
        if p.grad is not None:
            total += local_tensor(p.grad).numel() * p.grad.element_size()
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    total += local_tensor(value).numel() * value.element_size()
    return total


def lockstep_count(count: int, layout: Layout, device: torch.device) -> int:
    """The largest ``count`` over the ranks of a wrapped model (every rank must run that many
    forwards); ``count`` itself otherwise."""
    if not layout.wrapped or layout.world_size == 1:
        return count
    t = torch.tensor([count], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)
