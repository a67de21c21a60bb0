"""Token logprobs: NeMo-RL layout, temperature, packing equals padding equals one row at a time."""

from __future__ import annotations

import pytest
import torch

from nrl_tasks.models.policy.workers.logprobs import (
    length_mask,
    next_token_logprobs,
    packed_forward_logprobs,
    padded_forward_logprobs,
)

from .helpers import make_batch


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _one_row_at_a_time(model, ids, lengths, temperature):
    out = torch.zeros(ids.shape, dtype=torch.float32)
    for i, n in enumerate(lengths.tolist()):
        if n < 2:
            continue
        logits = model(ids[i : i + 1, :n]).logits[0, :-1].float() / temperature
        out[i, 1:n] = torch.log_softmax(logits, -1).gather(-1, ids[i, 1:n, None]).squeeze(-1)
    return out


@torch.no_grad()
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_padded_and_packed_match_unpadded_rows(model, temperature):
    batch = make_batch(6, 24, seed=3, min_len=1, rl_keys=False)
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    expected = _one_row_at_a_time(model, ids, lengths, temperature)
    padded = padded_forward_logprobs(model, ids, lengths, temperature)
    packed = packed_forward_logprobs(model, ids, lengths, temperature, pad_multiple=4)
    # float32 kernels over different shapes: agreement to rounding
    torch.testing.assert_close(padded, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed, expected, rtol=0, atol=1e-5)
    assert (padded[:, 0] == 0).all()
    assert (padded[~length_mask(lengths, ids.shape[1])] == 0).all()
    assert (packed[~length_mask(lengths, ids.shape[1])] == 0).all()


def test_next_token_logprobs_definition():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [3.0, 0.0, 0.0], [9.0, 9.0, 9.0]]])
    ids = torch.tensor([[0, 2, 1]])
    got = next_token_logprobs(logits, ids, temperature=2.0)
    want = torch.stack([torch.log_softmax(logits[0, 0] / 2, -1)[2], torch.log_softmax(logits[0, 1] / 2, -1)[1]])
    torch.testing.assert_close(got[0], want)


def test_packed_gradients_match_padded(model):
    batch = make_batch(4, 16, seed=5, rl_keys=False)
    ids, lengths = batch["input_ids"], batch["input_lengths"]
    grads = []
    for fn in (padded_forward_logprobs, packed_forward_logprobs):
        model.zero_grad(set_to_none=True)
        fn(model, ids, lengths).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5, msg=name)
