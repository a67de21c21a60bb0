"""ClippedPGLossFn / NLLLossFn: ARCHITECTURE.md's worked numbers, global normalisation, gradients."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from nrl_tasks.algorithms.loss_functions import ClippedPGLossConfig, ClippedPGLossFn, LossType, NLLLoss, NLLLossFn

LOG_HALF = math.log(0.5)


def _reference_example(ref_logprob: float = LOG_HALF):
    """token_mask [0,1,1,1], advantages [*,1,1,-1], prev = gen = log 0.5, curr - prev = [.5,-.1,.5]."""
    data = {
        "token_mask": torch.tensor([[0, 1, 1, 1]]),
        "sample_mask": torch.tensor([1.0]),
        "advantages": torch.tensor([[0.0, 1.0, 1.0, -1.0]]),
        "prev_logprobs": torch.tensor([[0.0, LOG_HALF, LOG_HALF, LOG_HALF]]),
        "generation_logprobs": torch.tensor([[0.0, LOG_HALF, LOG_HALF, LOG_HALF]]),
        "reference_policy_logprobs": torch.tensor([[0.0, ref_logprob, ref_logprob, ref_logprob]]),
    }
    curr = (torch.tensor([[0.5, -0.1, 0.5]]) + LOG_HALF).requires_grad_(True)
    return curr, data


def test_config_defaults_match_nemo_rl_and_reject_unknown_keys():
    cfg = ClippedPGLossConfig()
    assert cfg.reference_policy_kl_penalty == 0.01
    assert cfg.reference_policy_kl_type == "k3"
    assert (cfg.kl_input_clamp_value, cfg.kl_output_clamp_value) == (20.0, 10.0)
    assert (cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.ratio_clip_c) == (0.2, 0.2, None)
    assert not cfg.use_on_policy_kl_approximation and not cfg.use_importance_sampling_correction
    assert cfg.token_level_loss and cfg.truncated_importance_sampling_ratio is None
    with pytest.raises(ValidationError, match="ratio_clip_mn"):
        ClippedPGLossConfig(ratio_clip_mn=0.1)
    with pytest.raises(ValidationError, match="ratio_clip_c"):
        ClippedPGLossConfig(ratio_clip_c=0.5)
    with pytest.raises(ValidationError, match="use_importance_sampling_correction"):
        ClippedPGLossConfig(truncated_importance_sampling_ratio=2.0)
    with pytest.raises(ValidationError, match="reference_policy_kl_type"):
        ClippedPGLossConfig(reference_policy_kl_type="k5")


def test_clipped_pg_reference_number_without_kl():
    curr, data = _reference_example()
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))
    assert loss_fn.loss_type is LossType.TOKEN_LEVEL
    loss, metrics = loss_fn(curr, data, global_valid_seqs=1, global_valid_toks=3)
    assert loss.ndim == 0
    assert loss.item() == pytest.approx(-0.15204, abs=1e-5)
    assert metrics["loss"] == pytest.approx(-0.15204, abs=1e-5)
    assert metrics["kl_penalty"] == 0.0
    assert metrics["num_valid_samples"] == 1.0
    ratios = torch.exp(torch.tensor([0.5, -0.1, 0.5]))
    assert metrics["probs_ratio"] == pytest.approx(ratios.mean().item(), rel=1e-6)
    assert metrics["probs_ratio_clamped"] == pytest.approx(ratios.clamp(0.8, 1.2).mean().item(), rel=1e-6)
    assert metrics["token_mult_prob_error"] == pytest.approx(1.0)


def test_clipped_pg_reference_number_with_k3_kl():
    curr, data = _reference_example()
    loss, metrics = ClippedPGLossFn({"reference_policy_kl_penalty": 0.01})(curr, data, 1, 3)
    assert loss.item() == pytest.approx(-0.15131, abs=1e-5)
    assert metrics["kl_penalty"] == pytest.approx(0.07274, abs=1e-5)


@pytest.mark.parametrize("kl_type,expected", [("k1", [0.5, -1.0]), ("k2", [0.125, 0.5]), ("k3", [0.1065, 0.7183])])
def test_kl_kinds_in_the_loss(kl_type, expected):
    # logp [-1, -2], ref [-1.5, -1], zero advantages: loss = beta * mean(kl)
    data = {
        "token_mask": torch.tensor([[0, 1, 1]]),
        "sample_mask": torch.tensor([1]),
        "advantages": torch.zeros(1, 3),
        "prev_logprobs": torch.tensor([[0.0, -1.0, -2.0]]),
        "generation_logprobs": torch.tensor([[0.0, -1.0, -2.0]]),
        "reference_policy_logprobs": torch.tensor([[0.0, -1.5, -1.0]]),
    }
    curr = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=1.0, reference_policy_kl_type=kl_type))
    loss, metrics = loss_fn(curr, data, 1, 2)
    assert metrics["kl_penalty"] == pytest.approx(sum(expected) / 2, abs=1e-4)
    assert loss.item() == pytest.approx(sum(expected) / 2, abs=1e-4)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # A = -1, ratio e^2 = 7.39: plain clip gives loss 7.39; dual clip with c = 3 caps it at 3
    data = {
        "token_mask": torch.tensor([[0, 1, 1]]),
        "sample_mask": torch.tensor([1]),
        "advantages": torch.tensor([[0.0, -1.0, 1.0]]),
        "prev_logprobs": torch.tensor([[0.0, -3.0, -3.0]]),
        "generation_logprobs": torch.tensor([[0.0, -3.0, -3.0]]),
        "reference_policy_logprobs": torch.zeros(1, 3),
    }
    curr = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    plain = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})(curr, data, 1, 2)[0]
    dual = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0, "ratio_clip_c": 3.0})(curr, data, 1, 2)[0]
    # positive advantage: max(-e^2, -1.2) = -1.2 in both
    assert plain.item() == pytest.approx((math.exp(2) - 1.2) / 2, rel=1e-6)
    assert dual.item() == pytest.approx((3.0 - 1.2) / 2, rel=1e-6)


def _random_batch(b: int = 8, s: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(b, s)
    for i in range(b):  # prompt of 3 tokens, response of random length, then padding
        token_mask[i, 3 : 3 + int(torch.randint(1, s - 3, (1,), generator=g))] = 1
    data = {
        "token_mask": token_mask,
        "sample_mask": (torch.rand(b, generator=g) > 0.2).float(),
        "advantages": torch.randn(b, 1, generator=g).expand(b, s) * token_mask,
        "prev_logprobs": -torch.rand(b, s, generator=g) * 3 * token_mask,
        "generation_logprobs": -torch.rand(b, s, generator=g) * 3 * token_mask,
        "reference_policy_logprobs": -torch.rand(b, s, generator=g) * 3 * token_mask,
    }
    curr = -torch.rand(b, s - 1, generator=g) * 3
    return curr, data


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"token_level_loss": False},
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 2.0},
        {"use_on_policy_kl_approximation": True, "ratio_clip_c": 3.0, "reference_policy_kl_type": "k2"},
    ],
)
def test_microbatch_losses_and_grads_sum_to_the_global_batch(cfg):
    curr, data = _random_batch()
    loss_fn = ClippedPGLossFn(cfg)
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    gseqs, gtoks = data["sample_mask"].sum(), mask.sum()

    full_in = curr.clone().requires_grad_(True)
    full_loss, full_metrics = loss_fn(full_in, data, gseqs, gtoks)
    full_loss.backward()

    mb_in = curr.clone().requires_grad_(True)
    total, summed = torch.zeros(()), {}
    for i in range(0, 8, 2):
        mb = {k: v[i : i + 2] for k, v in data.items()}
        loss, metrics = loss_fn(mb_in[i : i + 2], mb, gseqs, gtoks)
        total = total + loss
        for k, v in metrics.items():
            summed[k] = summed.get(k, 0.0) + v
    total.backward()
    torch.testing.assert_close(total, full_loss)
    torch.testing.assert_close(mb_in.grad, full_in.grad)
    for key in ("loss", "kl_penalty", "probs_ratio", "token_mult_prob_error", "num_valid_samples"):
        assert summed[key] == pytest.approx(full_metrics[key], rel=1e-5, abs=1e-6), key
    # gradients reach the valid tokens only
    assert full_in.grad[mask > 0].abs().sum() > 0
    assert torch.all(full_in.grad[mask == 0] == 0)


def test_sequence_level_loss_weights_sequences_equally():
    # two sequences with A = 1 and ratio 1: per-token loss -1 everywhere, lengths 1 and 3
    data = {
        "token_mask": torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1]]),
        "sample_mask": torch.ones(2),
        "advantages": torch.tensor([[0.0, 2.0, 0, 0], [0.0, 1.0, 1.0, 1.0]]),
        "prev_logprobs": torch.full((2, 4), -1.0),
        "generation_logprobs": torch.full((2, 4), -1.0),
        "reference_policy_logprobs": torch.full((2, 4), -1.0),
    }
    curr = torch.full((2, 3), -1.0, requires_grad=True)
    seq = ClippedPGLossFn({"token_level_loss": False, "reference_policy_kl_penalty": 0.0})
    tok = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})
    assert seq.loss_type is LossType.SEQUENCE_LEVEL
    assert seq(curr, data, 2, 4)[0].item() == pytest.approx(-(2.0 + 1.0) / 2)
    assert tok(curr, data, 2, 4)[0].item() == pytest.approx(-(2.0 + 3.0) / 4)


def test_importance_sampling_correction_weights_by_prev_over_generation():
    curr, data = _reference_example()
    data["generation_logprobs"] = data["generation_logprobs"] + torch.tensor([[0.0, 0.1, 0.1, 0.1]])
    base = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})(curr, data, 1, 3)
    corrected = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True})(
        curr, data, 1, 3
    )
    assert corrected[0].item() == pytest.approx(base[0].item() * math.exp(-0.1), rel=1e-5)
    assert corrected[1]["sampling_importance_ratio"] == pytest.approx(math.exp(-0.1), rel=1e-5)
    assert base[1]["token_mult_prob_error"] == pytest.approx(math.exp(0.1), rel=1e-5)
    truncated = ClippedPGLossFn(
        {"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True,
         "truncated_importance_sampling_ratio": 0.5}
    )(curr, data, 1, 3)
    assert truncated[0].item() == pytest.approx(base[0].item() * 0.5, rel=1e-5)


def test_nan_in_padding_does_not_reach_loss_or_gradient():
    curr, data = _random_batch()
    pad = data["token_mask"] == 0
    for key in ("prev_logprobs", "generation_logprobs", "reference_policy_logprobs", "advantages"):
        data[key] = data[key].masked_fill(pad, float("nan"))
    curr.requires_grad_(True)
    loss, metrics = ClippedPGLossFn()(curr, data, None, None)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(curr.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_clear_errors_for_missing_keys_and_shapes():
    curr, data = _reference_example()
    loss_fn = ClippedPGLossFn()
    with pytest.raises(ValueError, match="advantages"):
        loss_fn(curr, {k: v for k, v in data.items() if k != "advantages"}, 1, 3)
    with pytest.raises(ValueError, match="prev_logprobs"):
        loss_fn(curr, {**data, "prev_logprobs": torch.zeros(1, 3)}, 1, 3)
    with pytest.raises(ValueError, match="sample_mask"):
        loss_fn(curr, {**data, "sample_mask": torch.ones(2)}, 1, 3)
    with pytest.raises(ValueError, match="next_token_logprobs"):
        loss_fn(curr[0], data, 1, 3)


def test_nll_loss_global_normalisation_and_gradient():
    curr, data = _random_batch()
    curr.requires_grad_(True)
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    assert NLLLoss is NLLLossFn and NLLLossFn.loss_type is LossType.TOKEN_LEVEL
    loss, metrics = NLLLossFn()(curr, data, None, mask.sum())
    assert loss.item() == pytest.approx((-(curr * mask).sum() / mask.sum()).item(), rel=1e-6)
    assert metrics["num_unmasked_tokens"] == mask.sum().item()
    halves = sum(NLLLossFn()(curr[i : i + 4], {k: v[i : i + 4] for k, v in data.items()}, None, mask.sum())[0]
                 for i in (0, 4))
    torch.testing.assert_close(halves, loss)
    loss.backward()
    torch.testing.assert_close(curr.grad, -mask / mask.sum())


def test_importance_sampling_correction_per_token_against_hand_computed_numbers():
    """Token-level weights ``w_t = exp(prev_t - gen_t)``, detached: the loss is
    ``sum_t w_t * (-A_t * r_t) / N`` and its gradient ``-w_t * A_t * r_t / N`` (``r_t = 1`` here);
    the metrics report the mean and the max weight."""
    data = {
        "token_mask": torch.tensor([[0, 1, 1, 1]]),
        "sample_mask": torch.tensor([1.0]),
        "advantages": torch.tensor([[0.0, 1.0, -1.0, 2.0]]),
        "prev_logprobs": torch.tensor([[0.0, LOG_HALF, LOG_HALF, LOG_HALF]]),
        "generation_logprobs": torch.tensor([[0.0, LOG_HALF + 0.2, LOG_HALF - 0.3, LOG_HALF]]),
        "reference_policy_logprobs": torch.tensor([[0.0, LOG_HALF, LOG_HALF, LOG_HALF]]),
    }
    curr = torch.full((1, 3), LOG_HALF).requires_grad_(True)  # = prev: every ratio is 1
    loss, metrics = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True})(
        curr, data, 1, 3
    )
    w = [math.exp(-0.2), math.exp(0.3), 1.0]
    adv = [1.0, -1.0, 2.0]
    assert loss.item() == pytest.approx(sum(wt * -a for wt, a in zip(w, adv)) / 3, rel=1e-6)
    loss.backward()
    assert curr.grad[0].tolist() == pytest.approx([-wt * a / 3 for wt, a in zip(w, adv)], rel=1e-6)
    assert metrics["sampling_importance_ratio"] == pytest.approx(sum(w) / 3, rel=1e-6)
    assert metrics["sampling_importance_ratio_max"] == pytest.approx(math.exp(0.3), rel=1e-6)


def test_train_metrics_sum_globally_normalised_micro_batch_figures():
    from nrl_tasks.stages.train import train_metrics

    # two micro-batches of one global batch, each figure already divided by the global count
    result = {"loss": 0.25, "num_global_batches": 1, "all_mb_metrics": {
        "probs_ratio": [0.5, 0.5], "sampling_importance_ratio_max": [1.2, 1.5], "num_valid_samples": [8.0, 8.0]}}
    m = train_metrics(result)
    assert m["probs_ratio"] == pytest.approx(1.0) and m["num_valid_samples"] == 16.0
    assert m["sampling_importance_ratio_max"] == 1.5 and m["loss"] == 0.25
