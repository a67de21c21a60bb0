"""Producer side of a refit, mixed into ``PolicyWorker``.

What travels: :func:`refit_named_tensors` of the model, i.e. ``model.state_dict()`` in order,
each tensor once (a tied ``lm_head.weight`` that aliases the embedding is skipped), floating-point
tensors cast to the refit dtype (the generation precision, else the policy precision); integer
buffers travel as they are. Only data-parallel rank 0 sends (it is rank 0 of the refit group).
With sharded FSDP2 parameters each tensor is gathered whole just before it is packed
(``DTensor.full_tensor()``, a collective in which every policy rank takes part in the same order),
so no rank ever holds more than one bucket plus one gathered tensor beyond its shard; otherwise
the other ranks hold identical weights and do nothing.

With LoRA (``dtensor_cfg.lora_cfg.enabled``) a refit sends only the adapters:
:func:`~nrl_tasks.models.policy.workers.lora.adapter_named_tensors`, with the adapter layout in
``RefitInfo.adapter``. The generation workers hold the base weights from their model folder and
apply the adapters: the HF backend unmerged in its own model, the vLLM backend through vLLM's LoRA
support (:mod:`nrl_tasks.models.generation.vllm_lora`). ``weights_checksum()`` is of what a refit
sends, so the adapters-only checksum covers the adapters (the base is the run's frozen model
folder).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from nrl_tasks.models.lora_adapters import adapter_layout
from nrl_tasks.models.policy.workers.parallel import full_tensor
from nrl_tasks.utils.collective import create_broadcast_group
from nrl_tasks.utils.packed_tensor import get_target_packed_tensor_size
from nrl_tasks.utils.refit import CHECKSUM_ALGORITHM, RefitInfo, dtype_from_str, weights_checksum

__all__ = ["RefitMixin", "refit_named_tensors"]


def refit_named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of ``model.state_dict()`` in order, aliases of an earlier tensor skipped."""
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:
            continue
        seen.add(key)
        yield name, tensor.detach()


class RefitMixin:
    """Refit methods of a policy worker (expects ``self.model``, ``self.cfg``, ``self.rank``)."""

    _refit_group: Any = None
    _refit_info: Any = None

    def _refit_dtype(self) -> torch.dtype:
        return dtype_from_str(self.cfg.refit_dtype)

    def _cast_for_refit(self, item: tuple[str, torch.Tensor]) -> torch.Tensor:
        tensor = item[1]
        if tensor.is_floating_point():
            return tensor.to(self._refit_dtype())
        return tensor

    def _adapters_only(self) -> bool:
        """LoRA refits send only the adapters (every generation backend applies them)."""
        return self.cfg.lora is not None

    def _refit_parts(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors a refit sends as this rank holds them (``DTensor``s when sharded; their
        ``shape`` is the whole tensor's)."""
        if self._adapters_only():
            from nrl_tasks.models.lora_adapters import adapter_named_tensors

            return adapter_named_tensors(self.model.get_base_model())
        return refit_named_tensors(self.model)

    def _refit_source(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors a refit sends, before the cast, each whole (gathered one at a time)."""

        return ((name, full_tensor(tensor)) for name, tensor in self._refit_parts())

    def _gathers_with_all_ranks(self) -> bool:
        """Whether whole tensors are gathered by a collective of all policy ranks (sharded)."""
        return self.layout.sharded

    def _refit_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._refit_source():
            yield name, self._cast_for_refit((name, tensor))

    def prepare_refit_info(self) -> dict[str, Any] | None:
        """``RefitInfo.to_dict()`` of what a broadcast will send (rank 0; others return None)."""
        self._require_ready()
        if self.rank != 0:
            return None

        dtype = self._refit_dtype()
        shapes = (
            (n, torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="meta"))
            for n, t in self._refit_parts()
        )

        adapter = adapter_layout(self.model.get_base_model()) if self._adapters_only() else None
        self._refit_info = RefitInfo.build(shapes, get_target_packed_tensor_size(), self.weights_version, adapter)
        return self._refit_info.to_dict()

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int = 1) -> bool:
        """Rank 0 joins the stateless broadcast group as group rank 0 (blocks until all join).

        ``train_world_size`` (NeMo-RL's argument) is accepted and not used: whatever the
        data-parallel size, only policy rank 0 joins the group (the ranks hold equal weights).
        """
        self._require_ready()
        if isinstance(train_world_size, bool) or not isinstance(train_world_size, int) or train_world_size < 1:
            raise ValueError(f"train_world_size must be a positive int, got {train_world_size!r}")
        if self.rank != 0:
            return False

        self.close_refit_group()
        timeout = self.cfg.generation.refit_timeout_s if self.cfg.generation is not None else 120.0
        backend = "nccl" if self.device.type == "cuda" and self.cfg.dp_backend != "gloo" else "gloo"
        self._refit_group = create_broadcast_group(ip, int(port), 0, int(world_size), timeout_s=timeout, backend=backend)
        return True

    def broadcast_weights_for_collective(self, kv_scales: dict[str, float] | None = None) -> bool:
        """Rank 0 streams the weights with the packed producer over the refit group."""
        self._require_valid_weights("broadcast_weights_for_collective")
        if kv_scales is not None:
            raise ValueError("kv_scales (FP8 KV-cache scales) are not supported")
        if self.rank != 0:
            if self._gathers_with_all_ranks():
                with torch.no_grad():
                    for _ in self._refit_source():  # take part in rank 0's gathers, in its order
                        pass
            return False
        if self._refit_group is None:
            raise RuntimeError("broadcast_weights_for_collective before init_collective")
        from nrl_tasks.utils.packed_tensor import get_target_packed_tensor_size, packed_broadcast_producer

        size = self._refit_info.buffer_size_bytes if self._refit_info is not None else get_target_packed_tensor_size()
        with torch.no_grad():
            packed_broadcast_producer(
                self._refit_source(),
                self._refit_group,
                0,
                self._cast_for_refit,
                buffer_size_bytes=size,
            )
        return True

    def weights_checksum(self, as_sent: bool = True, algorithm: str | None = None) -> str:
        """``weights_checksum`` of the refit tensors (cast as sent, or the master weights; with
        LoRA "as sent" is the merged weights, the master weights are base + adapter tensors);
        ``algorithm``: today's by default (see :func:`nrl_tasks.utils.refit.checksum_algorithm`)."""
        self._require_valid_weights("weights_checksum")

        if self.rank != 0 and not self._gathers_with_all_ranks():
            return ""  # rank 0's answer is the policy's
        if as_sent:
            items = self._refit_items()
        else:
            items = ((n, full_tensor(t)) for n, t in refit_named_tensors(self.model))
        return weights_checksum(items, algorithm or CHECKSUM_ALGORITHM)

    def close_refit_group(self) -> None:
        group, self._refit_group = self._refit_group, None
        if group is not None:
            try:
                group.close()
            except Exception:  # noqa: BLE001 - partner already gone
                pass
