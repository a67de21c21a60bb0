"""The distillation loss (nrl_tasks.algorithms.distillation) against values worked out by hand.

One row, three positions (two response tokens after a prompt token), a vocabulary of 4 and the
teacher's top 2. The expected figures are computed below with plain ``math`` over Python lists,
token by token, from the definitions in the module docstring: nothing of the module is reused.
"""

from __future__ import annotations

import math

import pytest
import torch

from nrl_tasks.algorithms.distillation import DistillationLossConfig, DistillationLossFn, topk_logprobs

STUDENT = [[0.5, -1.0, 2.0, 0.0], [1.0, 1.0, -2.0, 0.3], [0.0, 0.0, 0.0, 0.0]]  # logits per position (V = 4)
TEACHER_IDX = [[2, 0], [1, 3], [0, 1]]
TEACHER_LOGITS = [[3.0, 1.0], [0.2, -0.4], [0.0, 0.0]]
TOKEN_MASK = [0, 1, 1]  # position 0 is the prompt; the loss covers tokens 1..2, i.e. positions 0 and 1


def _log_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    z = math.log(sum(math.exp(x - m) for x in xs)) + m
    return [x - z for x in xs]


def _expected(kl_type: str, weight: float, zero_outside: bool) -> float:
    per_token = []
    for t in range(2):  # positions 0 and 1 predict the response tokens 1 and 2
        idx = TEACHER_IDX[t]
        log_q = _log_softmax(TEACHER_LOGITS[t])
        if zero_outside:
            full = _log_softmax(STUDENT[t])
            log_p = [full[i] for i in idx]
        else:
            log_p = _log_softmax([STUDENT[t][i] for i in idx])
        fwd = sum(math.exp(lq) * (lq - lp) for lq, lp in zip(log_q, log_p))
        rev = sum(math.exp(lp) * (lp - lq) for lq, lp in zip(log_q, log_p))
        w = {"forward": 1.0, "reverse": 0.0, "mixed": weight}[kl_type]
        kl = w * fwd + (1 - w) * rev
        if zero_outside and kl_type != "forward":  # the teacher gives e^-100 to the tokens outside its top 2
            full = _log_softmax(STUDENT[t])
            outside = sum(math.exp(full[v]) * (full[v] + 100.0) for v in range(4) if v not in idx)
            kl += (1 - w) * outside
        per_token.append(kl)
    return sum(per_token) / 2


def _batch() -> dict[str, torch.Tensor]:
    return {
        "teacher_topk_logits": torch.tensor([TEACHER_LOGITS]),
        "teacher_topk_indices": torch.tensor([TEACHER_IDX]),
        "token_mask": torch.tensor([TOKEN_MASK], dtype=torch.float32),
        "sample_mask": torch.ones(1),
    }


@pytest.mark.parametrize("zero_outside", [False, True])
@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
def test_the_loss_equals_the_hand_worked_value(kl_type, zero_outside):
    fn = DistillationLossFn(DistillationLossConfig(kl_type=kl_type, mixed_kl_weight=0.3, zero_outside_topk=zero_outside))
    loss, metrics = fn(torch.tensor([STUDENT]), _batch(), 1.0, 2.0)  # 2 valid tokens in the global batch
    expected = _expected(kl_type, 0.3, zero_outside)
    assert loss.item() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert expected > 0


def test_zero_outside_topk_makes_the_reverse_kl_count_the_students_mass_elsewhere():
    """The student puts much of its mass outside the teacher's top 2: with zero_outside_topk the
    reverse KL is large (those tokens have teacher probability e^-100), without it they are invisible."""
    with_mass = _expected("reverse", 0.5, True)
    renormalised = _expected("reverse", 0.5, False)
    assert with_mass > 10 * renormalised


def test_micro_batch_losses_sum_to_the_global_mean_and_the_gradient_flows():
    logits = torch.tensor([STUDENT, STUDENT], requires_grad=True)
    data = {k: torch.cat([v, v]) for k, v in _batch().items()}
    data["sample_mask"] = torch.tensor([1.0, 0.0])  # the second row does not count
    fn = DistillationLossFn(DistillationLossConfig(kl_type="reverse"))
    loss, _ = fn(logits, data, 1.0, 2.0)
    assert loss.item() == pytest.approx(_expected("reverse", 0.5, False), rel=1e-5)
    loss.backward()
    assert logits.grad[0].abs().sum() > 0 and logits.grad[1].abs().sum() == 0
    half = {k: v[:1] for k, v in data.items()}
    parts = [fn(logits[:1].detach(), half, 1.0, 4.0)[0], fn(logits[:1].detach(), half, 1.0, 4.0)[0]]
    assert sum(p.item() for p in parts) == pytest.approx(loss.item(), rel=1e-6)  # normalised by the global count


def test_a_student_equal_to_the_teacher_has_zero_kl_in_every_direction():
    logits = torch.tensor([[[3.0, -1.0, 1.0, 0.0]] * 3])
    top = logits.topk(2, dim=-1)
    data = {"teacher_topk_logits": top.values, "teacher_topk_indices": top.indices,
            "token_mask": torch.ones(1, 3), "sample_mask": torch.ones(1)}
    for kl_type in ("forward", "reverse", "mixed"):
        loss, m = DistillationLossFn(DistillationLossConfig(kl_type=kl_type))(logits, data, 1.0, 2.0)
        assert abs(loss.item()) < 1e-6 and abs(m["kl_forward"]) < 1e-6 and abs(m["kl_reverse"]) < 1e-6


def test_shapes_that_do_not_match_are_refused_naming_them():
    with pytest.raises(ValueError, match="cover different rows or positions"):
        topk_logprobs(torch.zeros(1, 3, 4), torch.zeros(1, 2, 2), torch.zeros(1, 2, 2, dtype=torch.long), zero_outside_topk=False)
    with pytest.raises(ValueError, match="top k is empty"):
        topk_logprobs(torch.zeros(1, 3, 4), torch.zeros(1, 3, 0), torch.zeros(1, 3, 0, dtype=torch.long), zero_outside_topk=False)
