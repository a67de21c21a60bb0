"""On-policy distillation's loss: the student's KL to the teacher's top-k next-token distribution
(Agarwal et al., "On-Policy Distillation of Language Models", https://arxiv.org/abs/2306.13649;
NeMo-RL's ``DistillationLossFn``, ``loss_fn: {kl_type, mixed_kl_weight, zero_outside_topk}``).

The student samples a sequence; at each of its response tokens ``t`` the teacher's ``k`` most
likely next tokens ``I_t`` with logits ``z_t`` are given (``teacher_topk_logits``,
``teacher_topk_indices``, from ``Policy.get_topk_logits``). With ``s`` the student's logits::

    q_t = softmax(z_t)                                   teacher, renormalised over its top k
    p_t = softmax(s_t[I_t])                              student over the same k tokens
          (zero_outside_topk: log p_t = log_softmax(s_t)[I_t], the student's full-vocabulary
           probabilities of those tokens; they sum to less than 1)

    forward  KL_t = sum_i q_ti (log q_ti - log p_ti)
    reverse  KL_t = sum_i p_ti (log p_ti - log q_ti)  [+ C_t with zero_outside_topk]
    mixed    KL_t = w * forward + (1 - w) * reverse   (w = mixed_kl_weight)  [+ (1 - w) C_t]

With ``zero_outside_topk`` the teacher's probability outside its top k is taken as ``e^-100``,
so the reverse KL gains the student's mass outside them:
``C_t = sum_{v not in I_t} p_tv (log p_tv + 100)`` (from the full-vocabulary entropy term
``H_t = sum_v p_tv log p_tv`` minus its top-k part). The loss is the mean of ``KL_t`` over the
response tokens of the valid samples of the global batch (``token_mask[:, 1:] * sample_mask``;
micro-batch losses sum to it), a token-level loss like GRPO's.

The worker hands this loss the student's logits ``[B, S, V]`` (float32, divided by the
generation temperature as the teacher's are): its ``input_type`` is ``"logits"``. Position ``t``
of the logits and of the teacher's top k predicts token ``t + 1``. Deviations from NeMo-RL:
none in the figures; metrics add ``kl_forward`` and ``kl_reverse`` (the two directions on the same
tokens, without the correction term) and ``teacher_topk_mass`` (the student's full-vocabulary
probability of the teacher's top k, a measure of agreement).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from nrl_tasks.algorithms.loss_functions import LossType
from nrl_tasks.algorithms.utils import masked_mean
from nrl_tasks.config.base import Section

__all__ = ["LOG_OUTSIDE_TOPK", "DistillationLossConfig", "DistillationLossFn", "topk_logprobs"]

#: the teacher's log-probability of a token outside its top k with ``zero_outside_topk``
LOG_OUTSIDE_TOPK = -100.0


class DistillationLossConfig(Section):
    """NeMo-RL's ``loss_fn`` keys of a distillation run (see the module docstring)."""

    kl_type: Literal["forward", "reverse", "mixed"] = Field(
        "mixed", description="forward: KL(teacher || student); reverse: KL(student || teacher); mixed: both, weighted")
    mixed_kl_weight: float = Field(0.5, ge=0.0, le=1.0, description="with kl_type=mixed: the forward KL's weight")
    zero_outside_topk: bool = Field(
        False, description="the teacher's probability outside its top k is 0 (the student's full-vocabulary "
        "probabilities of the top k; the reverse KL counts the student's mass outside them)")


def topk_logprobs(
    student_logits: Tensor, teacher_topk_logits: Tensor, teacher_topk_indices: Tensor, *, zero_outside_topk: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(log p, log q, H)`` of the module docstring for logits ``[B, S, V]`` and a top k
    ``[B, S, k]``: the student's and teacher's log-probabilities ``[B, S, k]`` of the teacher's
    top k, and with ``zero_outside_topk`` the student's ``sum_v p log p`` ``[B, S]`` (else None)."""
    if teacher_topk_indices.shape[-1] < 1:
        raise ValueError("the teacher's top k is empty (distillation.topk_logits_k must be >= 1)")
    if student_logits.shape[:2] != teacher_topk_indices.shape[:2]:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher top-k {tuple(teacher_topk_indices.shape)} "
                         "cover different rows or positions")
    s = student_logits.to(torch.float32)
    idx = teacher_topk_indices.to(s.device, torch.long)
    entropy = None
    if zero_outside_topk:
        full = torch.log_softmax(s, dim=-1)
        student = full.gather(-1, idx)
        entropy = (full.exp() * full).sum(-1)
    else:
        student = torch.log_softmax(s.gather(-1, idx), dim=-1)
    teacher = torch.log_softmax(teacher_topk_logits.to(s.device, torch.float32), dim=-1)
    return student, teacher, entropy


class DistillationLossFn:
    """The distillation loss (see the module docstring)."""

    loss_type = LossType.TOKEN_LEVEL
    #: what the worker passes as the first argument: the student's logits, ``[B, S, V]``
    input_type = "logits"
    metric_reductions: dict[str, str] = {}

    def __init__(self, cfg: DistillationLossConfig | None = None) -> None:
        self.cfg = cfg or DistillationLossConfig()

    def __call__(
        self,
        logits: Tensor,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float | None,
        global_valid_toks: Tensor | float | None,
    ) -> tuple[Tensor, dict[str, float]]:
        cfg = self.cfg
        log_p, log_q, entropy = topk_logprobs(logits, data["teacher_topk_logits"], data["teacher_topk_indices"],
                                              zero_outside_topk=cfg.zero_outside_topk)
        # position t predicts token t + 1: the loss covers the tokens 1..S-1 (NeMo-RL's alignment)
        log_p, log_q = log_p[:, :-1], log_q[:, :-1]
        p, q = log_p.exp(), log_q.exp()
        forward = (q * (log_q - log_p)).sum(-1)
        reverse = (p * (log_p - log_q)).sum(-1)
        w = {"forward": 1.0, "reverse": 0.0, "mixed": cfg.mixed_kl_weight}[cfg.kl_type]
        kl = w * forward + (1.0 - w) * reverse
        if entropy is not None and w < 1.0:  # the student's mass where the teacher has e^-100
            outside = entropy[:, :-1] - (p * log_p).sum(-1) - LOG_OUTSIDE_TOPK * (1.0 - p.sum(-1))
            kl = kl + (1.0 - w) * outside
        mask = data["token_mask"][:, 1:].to(kl.device, torch.float32) * data["sample_mask"].to(kl.device, torch.float32).unsqueeze(1)
        mean = lambda x: masked_mean(x, mask, global_normalization_factor=global_valid_toks)  # noqa: E731
        loss = mean(kl)
        with torch.no_grad():
            if cfg.zero_outside_topk:
                mass = p.sum(-1)
            else:  # log sum_{i in top k} p_i = logsumexp(s[top k]) - logsumexp(s): no second [B, S, V] softmax
                s = logits[:, :-1].to(torch.float32)
                top = s.gather(-1, data["teacher_topk_indices"][:, :-1].to(s.device, torch.long))
                mass = (torch.logsumexp(top, -1) - torch.logsumexp(s, -1)).exp()
            metrics = {"loss": loss.item(), "kl_forward": mean(forward).item(), "kl_reverse": mean(reverse).item(),
                       "teacher_topk_mass": mean(mass).item(), "num_valid_samples": float(data["sample_mask"].sum())}
        return loss, metrics
