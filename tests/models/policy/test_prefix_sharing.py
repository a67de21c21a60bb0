"""Shared-prompt forward: rows of a GRPO group run their prompt once and get the logprobs, loss and
gradient of the plain padded forward (to float32 rounding), in the function and in a PolicyWorker."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.models.policy.workers.in_process import in_process_worker
from nrl_tasks.models.policy.workers.logprobs import length_mask, padded_forward_logprobs
from nrl_tasks.models.policy.workers.prefix_sharing import (
    prefix_lengths_from_mask,
    prefix_plan,
    shared_prefix_logprobs,
)

#: (prompt length, completion lengths of its rows): groups of 6, 2, 1 and 2 rows (the first prompt
#: comes twice), and a prompt of 5 tokens that is the start of the 7-token one (its own group)
LAYOUT = [(7, [4, 9, 1]), (5, [6, 2]), (9, [3]), (7, [5, 5, 8]), (6, [2, 4])]


def grouped_batch(seed: int = 0, vocab: int = 300, common_start: bool = False) -> BatchedDataDict:
    """Right-padded rows ``prompt + completion`` with ``token_mask`` on the completions and the
    GRPO loss inputs; the prompts of groups 0 and 1 begin alike, group 3 repeats group 0's;
    ``common_start``: all 4 prompts begin with the same 4 tokens (like a chat template's header)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (p,), generator=g) for p, _ in LAYOUT]
    prompts[1] = prompts[0][:5].clone()
    prompts[3] = prompts[0].clone()
    if common_start:
        prompts[2][:4] = prompts[0][:4]
        prompts[4][:4] = prompts[0][:4]
    rows = [(prompt, torch.randint(3, vocab, (n,), generator=g)) for prompt, (_, ns) in zip(prompts, LAYOUT) for n in ns]
    width = max(len(p) + len(c) for p, c in rows) + 2
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    token_mask = torch.zeros(len(rows), width)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.cat([p, c])
        token_mask[i, len(p) : len(p) + len(c)] = 1.0
    lengths = torch.tensor([len(p) + len(c) for p, c in rows])
    valid = length_mask(lengths, width)
    base = (-5.0 + 0.1 * torch.randn(len(rows), width, generator=g)) * valid
    base[:, 0] = 0
    return BatchedDataDict({
        "input_ids": ids, "input_lengths": lengths, "token_mask": token_mask, "sample_mask": torch.ones(len(rows)),
        "advantages": torch.randn(len(rows), 1, generator=g) * token_mask,
        "prev_logprobs": base, "generation_logprobs": base, "reference_policy_logprobs": base + 0.05 * valid,
    })


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()


def test_plan_groups_rows_by_their_prompt():
    batch = grouped_batch()
    lengths = batch["input_lengths"]
    prefix = prefix_lengths_from_mask(batch["token_mask"], lengths)
    assert prefix.tolist() == [7, 7, 7, 5, 5, 9, 7, 7, 7, 6, 6]
    plan = prefix_plan(batch["input_ids"], lengths, prefix)
    assert plan.group_of_row == [0, 0, 0, 1, 1, 2, 0, 0, 0, 3, 3]
    assert plan.prefixes == [(0, 7), (3, 5), (5, 9), (9, 6)]
    assert plan.tokens_saved == 7 * 6 + 5 * 2 + 9 + 6 * 2 - (7 + 5 + 9 + 6)
    assert plan.common_length == 0  # the third and fourth prompts start otherwise
    common = prefix_plan(*(grouped_batch(common_start=True)[k] for k in ("input_ids", "input_lengths")), prefix)
    assert common.common_length == 4 and common.tokens_saved == plan.tokens_saved + 4 * 3
    # fewer prompts than MIN_COMMON_PROMPTS: no pass of their common start
    rows = [0, 1, 2, 3, 4, 5]
    three = prefix_plan(*(grouped_batch(common_start=True)[k][rows] for k in ("input_ids", "input_lengths")), prefix[rows])
    assert three.common_length == 0 and len(three.prefixes) == 3
    # nothing shared, or a row too short to have a token after its prompt: the plain forward
    alone = prefix_plan(batch["input_ids"][[0, 3, 5, 9]], lengths[[0, 3, 5, 9]], prefix[[0, 3, 5, 9]])
    assert alone is None
    short = lengths.clone()
    short[0] = 1
    assert prefix_plan(batch["input_ids"], short, prefix) is None


@pytest.mark.parametrize("temperature,common_start", [(1.0, False), (0.7, False), (1.0, True)])
def test_shared_forward_gives_the_plain_logprobs_loss_and_gradient(model, temperature, common_start):
    batch = grouped_batch(seed=1, common_start=common_start)
    ids, lengths, mask = batch["input_ids"], batch["input_lengths"], batch["token_mask"]
    plan = prefix_plan(ids, lengths, prefix_lengths_from_mask(mask, lengths))
    assert plan is not None and plan.common_length == (4 if common_start else 0)
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.05})
    tokens, seqs = mask[:, 1:].sum(), torch.tensor(float(len(lengths)))
    out = {}
    for name, forward in (("plain", lambda: padded_forward_logprobs(model, ids, lengths, temperature)),
                          ("shared", lambda: shared_prefix_logprobs(model, ids, plan, temperature))):
        model.zero_grad(set_to_none=True)
        lp = forward()
        loss, _ = loss_fn(lp[:, 1:], batch, seqs, tokens)
        loss.backward()
        out[name] = (lp.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    plain, shared = out["plain"], out["shared"]
    # every position a row has, prompt positions included; zeros elsewhere
    torch.testing.assert_close(shared[0], plain[0], rtol=0, atol=2e-5)
    assert (shared[0][~length_mask(lengths, ids.shape[1])] == 0).all() and (shared[0][:, 0] == 0).all()
    torch.testing.assert_close(shared[1], plain[1], rtol=1e-5, atol=1e-7)
    for name, grad in plain[2].items():
        torch.testing.assert_close(shared[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_worker_trains_alike_with_and_without_sharing(tiny_model_dir):
    """The worker's train and get_logprobs with ``share_prompt_prefix`` on (the default) and off."""
    batch = grouped_batch(seed=2, common_start=True)
    cfg = PolicyConfig(model_name=tiny_model_dir, train_global_batch_size=11, train_micro_batch_size=11,
                       max_grad_norm=None, optimizer={"kwargs": {"lr": 1e-3}}, generation={"temperature": 0.8})
    assert cfg.share_prompt_prefix
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.05})
    results, grads, logprobs = {}, {}, {}
    with in_process_worker(cfg) as worker:
        initial = {k: v.clone() for k, v in worker.model.state_dict().items()}
        opt_state = copy.deepcopy(worker.optimizer.state_dict())
        for share in (True, False):
            worker.cfg = cfg.model_copy(update={"share_prompt_prefix": share})
            worker.model.load_state_dict(initial)
            worker.optimizer.load_state_dict(copy.deepcopy(opt_state))
            logprobs[share] = worker.get_logprobs(batch)["logprobs"]
            results[share] = worker.train(batch, loss_fn)
            grads[share] = worker.get_gradients()
    torch.testing.assert_close(logprobs[True], logprobs[False], rtol=0, atol=2e-5)
    np.testing.assert_allclose(results[True]["global_loss"], results[False]["global_loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(results[True]["grad_norm"], results[False]["grad_norm"], rtol=1e-4)
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("common_start", [False, True])
def test_without_prompt_logprobs_the_head_skips_the_prompts_and_the_loss_is_the_same(model, common_start):
    """The train path (``prompt_logprobs=False``): the LM head runs only at each prompt's last
    position and the rows' own tokens, the prompt positions hold 0, and the loss (KL term included)
    and every gradient equal the plain forward's."""
    batch = grouped_batch(seed=2, common_start=common_start)
    ids, lengths, mask = batch["input_ids"], batch["input_lengths"], batch["token_mask"]
    prefix = prefix_lengths_from_mask(mask, lengths)
    plan = prefix_plan(ids, lengths, prefix)
    loss_fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.05})
    tokens, seqs = mask[:, 1:].sum(), torch.tensor(float(len(lengths)))
    head_rows: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda _m, inp, _o: head_rows.append(inp[0].shape[0] * inp[0].shape[1]))
    out = {}
    try:
        for name, forward in (("plain", lambda: padded_forward_logprobs(model, ids, lengths)),
                              ("full", lambda: shared_prefix_logprobs(model, ids, plan)),
                              ("trimmed", lambda: shared_prefix_logprobs(model, ids, plan, prompt_logprobs=False))):
            model.zero_grad(set_to_none=True)
            head_rows.clear()
            lp = forward()
            loss, _ = loss_fn(lp[:, 1:], batch, seqs, tokens)
            loss.backward()
            out[name] = (lp.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(head_rows))
    finally:
        hook.remove()
    plain, full, trimmed = out["plain"], out["full"], out["trimmed"]
    # head rows of the prompt passes: every padded prompt position (the common start once) before,
    # then each prompt's last position (one column per distinct prompt length) and 1 for the start
    groups, p_max, common = len(plan.prefixes), max(p for _, p in plan.prefixes), plan.common_length
    columns = len({p for _, p in plan.prefixes})
    prompt_rows = common + groups * (p_max - common) if common else groups * p_max
    assert trimmed[3] == full[3] - prompt_rows + groups * columns + (1 if common else 0) < full[3]
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    own = (pos >= prefix.unsqueeze(1)) & length_mask(lengths, ids.shape[1])
    torch.testing.assert_close(trimmed[0][own], plain[0][own], rtol=0, atol=2e-5)
    assert (trimmed[0][~own] == 0).all()  # the prompts (and the padding) hold 0
    torch.testing.assert_close(trimmed[1], plain[1], rtol=1e-5, atol=1e-7)
    for name, grad in plain[2].items():
        torch.testing.assert_close(trimmed[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)
