"""One fixed batch through this project's TRL-like preset and through TRL's GRPO loss, written out here.

The preset is ``configs/grpo_smollm2_vs_trl.yaml`` (what ``benchmarks/bench_vs_trl.py`` runs next to
TRL). The reference below is TRL 1.16's ``GRPOTrainer`` math with its defaults (read from its source:
``_generate_and_score_completions`` and ``_compute_loss``), not its code:

- ``scale_rewards="group"``: ``A = (r - mean_g r) / (std_g r + 1e-4)``, std with Bessel's correction;
- ``num_iterations=1``: the old logprobs are the current ones detached, ratio ``exp(logp - sg(logp))``;
- ``epsilon=0.2`` both sides: ``L_t = -min(ratio * A, clip(ratio, 0.8, 1.2) * A)``; ``beta=0``: no KL;
- ``loss_type="dapo"``: each micro-batch's ``sum_t L_t * mask_t`` is divided by the number of
  completion tokens of the whole generation batch (``num_items_in_batch``), and gradient
  accumulation adds the micro-batches up (``loss_is_scaled_for_ga``): one optimizer step per batch.

The project side runs the real code: ``compute_advantages`` (the ``advantages`` stage),
``build_train_data`` (the ``train`` stage's loss input) and ``ClippedPGLossFn`` on micro-batches of
``policy.train_micro_batch_size`` with the policy worker's ``global_valid_toks``.
"""

from __future__ import annotations

import pytest
import torch

from flows.config import load_config
from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.stages.advantages import compute_advantages
from nrl_tasks.stages.train import build_train_data

PRESET = "configs/grpo_smollm2_vs_trl.yaml"
GROUP = 4
VOCAB = 11
#: rewards per group of 4: one right, three right, none (zero std: no signal), graded
REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 0.0, 0.25]
PROMPT_LENS = [3, 3, 3, 3, 5, 5, 5, 5, 4, 4, 4, 4, 6, 6, 6, 6]
RESPONSE_LENS = [1, 7, 4, 8, 2, 8, 5, 3, 6, 1, 2, 8, 4, 3, 7, 5]


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids ``[B, S]`` (prompt, response, right padding) and leaf logits ``[B, S, V]``."""
    g = torch.Generator().manual_seed(seed)
    b, width = len(REWARDS), max(p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS))
    ids = torch.randint(1, VOCAB, (b, width), generator=g)
    token_mask = torch.zeros(b, width)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        ids[i, p + r:] = 0  # pad
        token_mask[i, p:p + r] = 1.0
    logits = (2.0 * torch.randn(b, width, VOCAB, generator=g, dtype=torch.float32)).requires_grad_()
    return {"ids": ids, "token_mask": token_mask, "logits": logits}


def _next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[B, S-1]``: position t scores token t+1 (the policy worker's ``lp[:, 1:]``)."""
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def project_loss(batch: dict[str, torch.Tensor], overrides: list[str] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, d loss / d logits)`` through the preset: advantages stage, train-stage input, loss per micro-batch."""
    cfg = load_config(PRESET, list(overrides))
    ids, token_mask, logits = batch["ids"], batch["token_mask"], batch["logits"]
    b = ids.shape[0]
    group_id = torch.arange(b) // GROUP
    adv = compute_advantages(group_id, torch.tensor(REWARDS), torch.ones(b), cfg.grpo, loss_cfg=cfg.loss_fn)
    lp = _next_token_logprobs(logits, ids)
    gen_lp = torch.zeros_like(token_mask)
    gen_lp[:, 1:] = lp.detach() * token_mask[:, 1:]
    rollouts = BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor(PROMPT_LENS) + torch.tensor(RESPONSE_LENS),
                                "token_mask": token_mask, "generation_logprobs": gen_lp})
    data = build_train_data(rollouts, None, adv)
    loss_fn = ClippedPGLossFn(cfg.loss_fn)
    # the policy worker's normaliser: response tokens of the whole global batch (train_worker._train_global_batch)
    global_valid_toks = (data["token_mask"][:, 1:].double() * data["sample_mask"].double().unsqueeze(1)).sum().float()
    global_valid_seqs = data["sample_mask"].double().sum().float()
    mbs = cfg.policy.train_micro_batch_size
    assert cfg.policy.train_global_batch_size == cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    total = torch.zeros(())
    for start in range(0, b, mbs):
        rows = slice(start, start + mbs)
        mb = {k: v[rows] for k, v in data.items()}
        loss, _ = loss_fn(_next_token_logprobs(logits[rows], ids[rows]), mb, global_valid_seqs, global_valid_toks)
        loss.backward()
        total = total + loss.detach()
    grad = logits.grad.clone()
    logits.grad = None
    return total, grad


def trl_loss(batch: dict[str, torch.Tensor], micro_batch: int = 8, epsilon: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, d loss / d logits)`` by TRL 1.16's formula (defaults, ``loss_type="dapo"``; see the module docstring)."""
    ids, logits = batch["ids"], batch["logits"]  # the token mask is rebuilt in TRL's layout below
    b, t_max = ids.shape[0], max(RESPONSE_LENS)
    # TRL's layout: completion_ids [B, T] and completion_mask [B, T], the prompt beside them
    completion_ids = torch.zeros(b, t_max, dtype=torch.long)
    completion_mask = torch.zeros(b, t_max)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        completion_ids[i, :r] = ids[i, p:p + r]
        completion_mask[i, :r] = 1.0

    rewards = torch.tensor(REWARDS)
    grouped = rewards.view(-1, GROUP)
    mean = grouped.mean(dim=1).repeat_interleave(GROUP)
    std = grouped.std(dim=1, correction=1).repeat_interleave(GROUP)  # TRL's nanstd: Bessel
    advantages = ((rewards - mean) / (std + 1e-4)).unsqueeze(1)  # scale_rewards="group"

    num_items_in_batch = completion_mask.sum()  # the whole generation batch
    total = torch.zeros(())
    for start in range(0, b, micro_batch):
        rows = list(range(start, min(start + micro_batch, b)))
        per_row = []
        for i in rows:  # logits at position p + t - 1 predict completion token t
            p = PROMPT_LENS[i]
            logp = torch.log_softmax(logits[i, p - 1:p - 1 + t_max].float(), dim=-1)
            per_row.append(logp.gather(-1, completion_ids[i].unsqueeze(-1)).squeeze(-1))
        per_token_logps = torch.stack(per_row)
        old_per_token_logps = per_token_logps.detach()  # num_iterations == 1
        coef_1 = torch.exp(per_token_logps - old_per_token_logps)
        coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon)
        adv, mask = advantages[rows], completion_mask[rows]
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
        loss = (per_token_loss * mask).sum() / num_items_in_batch.clamp(min=1.0)  # "dapo"
        loss.backward()  # gradient accumulation: the micro-batches add up
        total = total + loss.detach()
    grad = logits.grad.clone()
    logits.grad = None
    return total, grad


def test_the_trl_like_preset_gives_trls_loss_and_gradient_on_one_fixed_batch() -> None:
    batch = _batch()
    ours_loss, ours_grad = project_loss(batch)
    trl, trl_grad = trl_loss(batch)
    assert ours_grad.abs().sum() > 0 and trl.abs() > 1e-3  # a batch with signal
    torch.testing.assert_close(ours_loss, trl, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours_grad, trl_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("drift", [
    "grpo.use_leave_one_out_baseline=true",  # this project's default estimator
    "grpo.adv_estimator.std_epsilon=1e-6",  # NeMo-RL's epsilon
    "loss_fn.token_level_loss=false",  # per-sequence means (TRL's loss_type="grpo")
    "grpo.normalize_rewards=false",  # TRL's scale_rewards="none" (Dr. GRPO), not its default
    "policy.train_micro_batch_size=4",  # the same math whatever the micro-batch: must still match
])
def test_the_comparison_notices_drift(drift: str) -> None:
    """Every change of the math moves the gradient beyond the tolerance; a change of micro-batch does not."""
    batch = _batch()
    ours_loss, ours_grad = project_loss(batch, [drift])
    trl, trl_grad = trl_loss(batch)
    same = torch.allclose(ours_grad, trl_grad, rtol=1e-5, atol=1e-8) and torch.allclose(ours_loss, trl, rtol=1e-5, atol=1e-7)
    if drift.startswith("policy.train_micro_batch_size"):
        assert same
    else:
        assert not same, f"{drift} left the loss and gradient unchanged"
