"""Output specs and the interface of a policy (NeMo-RL names), for type checking.

Shapes: ``B`` rows, ``S`` the padded sequence length of the input batch, ``k`` the top-k.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, TypedDict, runtime_checkable

import torch

__all__ = [
    "ColocatablePolicyInterface",
    "LogprobOutputSpec",
    "PolicyInterface",
    "ReferenceLogprobOutputSpec",
    "ScoreOutputSpec",
    "TopkLogitsOutputSpec",
]


class LogprobOutputSpec(TypedDict):
    logprobs: torch.Tensor  # [B, S] float32; position 0 is 0, padding 0


class ReferenceLogprobOutputSpec(TypedDict):
    reference_logprobs: torch.Tensor  # [B, S] float32, same layout


class TopkLogitsOutputSpec(TypedDict):
    topk_logits: torch.Tensor  # [B, S, k] float32 (divided by temperature), padding 0
    topk_indices: torch.Tensor  # [B, S, k] int64


class ScoreOutputSpec(TypedDict):
    scores: torch.Tensor  # [B] float32


@runtime_checkable
class PolicyInterface(Protocol):
    """What the stages call on a policy."""

    def get_logprobs(self, data: Any, timer: Any = None) -> Any: ...

    def get_reference_policy_logprobs(self, data: Any, micro_batch_size: Optional[int] = None, timer: Any = None) -> Any: ...

    def train(self, data: Any, loss_fn: Any, eval_mode: bool = False, gbs: Optional[int] = None,
              mbs: Optional[int] = None, timer: Any = None) -> dict[str, Any]: ...

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None: ...

    def prepare_for_lp_inference(self, *args: Any, **kwargs: Any) -> None: ...

    def finish_training(self, *args: Any, **kwargs: Any) -> None: ...

    def save_checkpoint(self, weights_path: str, optimizer_path: Optional[str] = None,
                        tokenizer_path: Optional[str] = None) -> None: ...

    def shutdown(self) -> bool: ...


@runtime_checkable
class ColocatablePolicyInterface(PolicyInterface, Protocol):
    """A policy that can hand its weights to generation (refit) and share devices with it."""

    def prepare_refit_info(self) -> Optional[dict[str, Any]]: ...

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[Any]: ...

    def broadcast_weights_for_collective(self, kv_scales: Optional[dict[str, float]] = None) -> list[Any]: ...

    def offload_before_refit(self) -> None: ...

    def offload_after_refit(self) -> None: ...
