"""Optimizer, LR schedule, gradient clipping and finite checks for policy workers.

Gradients are reduced across data-parallel ranks by torch's FSDP2
(:mod:`~nrl_tasks.models.policy.workers.parallel`); with sharding they and the parameters are
``DTensor``s, whose norm is a collective (every rank calls :func:`clip_and_norm`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nrl_tasks.models.policy.workers.parallel import full_tensor, local_tensor

__all__ = [
    "all_finite", "build_optimizer", "build_scheduler", "clip_and_norm", "first_nonfinite",
    "trainable_named_parameters",
]


def trainable_named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, param)`` of parameters that require grad, tied ones once, in model order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def build_optimizer(named_params: list[tuple[str, torch.nn.Parameter]], cfg: Any) -> torch.optim.Optimizer:
    """AdamW over ``named_params`` from ``PolicyConfig.optimizer``."""
    kw = cfg.kwargs
    extra = {} if kw.foreach is None else {"foreach": kw.foreach}
    return torch.optim.AdamW(
        [p for _, p in named_params],
        lr=kw.lr,
        betas=tuple(kw.betas),
        eps=kw.eps,
        weight_decay=kw.weight_decay,
        **extra,
    )


class _ScheduleFactor:
    """Picklable-free LR multiplier (state lives in the scheduler's ``last_epoch``)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def __call__(self, step: int) -> float:
        return self.cfg.factor(step)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Any) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR from ``PolicyConfig.scheduler``; stepped once per optimizer step.

    The multiplier is a function of the step count only, so the scheduler's JSON state
    (``last_epoch``, ``base_lrs``, ``_last_lr``) is all a checkpoint needs.
    """
    factor = _ScheduleFactor(cfg)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda step: factor(step))


def clip_and_norm(params: list[torch.nn.Parameter], max_grad_norm: float | None) -> float:
    """Total L2 norm of the gradients before clipping; clips to ``max_grad_norm`` if set.

    A non-finite norm is returned without clipping (the caller refuses the step: scaling by
    ``max_norm / inf`` would silently zero the gradients, by ``inf / inf`` turn them NaN).
    Same arithmetic as ``torch.nn.utils.clip_grad_norm_`` otherwise (bit-identical results).
    """
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return 0.0
    norm = torch.nn.utils.get_total_norm([p.grad for p in with_grad], 2.0)
    norm = full_tensor(norm)  # a DTensor of partial sums with sharded gradients
    value = float(norm)
    if max_grad_norm is not None and math.isfinite(value):
        torch.nn.utils.clip_grads_with_norm_(with_grad, float(max_grad_norm), norm)
    return value


def first_nonfinite(named: list[tuple[str, torch.Tensor | None]]) -> str | None:
    """Name of the first tensor of ``named`` holding a NaN or inf (None entries skipped), or None."""
    for name, t in named:
        if t is not None and not bool(torch.isfinite(local_tensor(t)).all()):
            return name
    return None


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite (one device sync).

    First the sum of the tensors' sums (a NaN or inf anywhere makes it non-finite; no bool tensor
    the size of the weights: 0.03 instead of 0.27 s for SmolLM2-135M on CPU); only when that is
    not finite (also when finite values overflow the sum) is every element looked at."""
    if not tensors:
        return True
    parts = [local_tensor(t) for t in tensors]
    total = torch.stack([p.sum() for p in parts]).sum()
    if bool(torch.isfinite(total)):
        return True
    return bool(torch.stack([torch.isfinite(p).all() for p in parts]).all())
