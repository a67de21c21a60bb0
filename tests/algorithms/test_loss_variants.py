"""Every ``ClippedPGLossConfig`` variant against numbers worked out by hand in the test (from the
papers' formulas), values and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from nrl_tasks.algorithms.loss_functions import ClippedPGLossConfig, ClippedPGLossFn

E = math.exp


def _batch(curr, prev=None, gen=None, ref=None, adv=None, rewards=None):
    """Rows of response-token values (``[B][T]``) as a loss input: position 0 of ``[B, T+1]`` is
    the prompt (masked); ``curr`` is the trainable ``[B, T]`` next-token logprobs."""
    b, t = len(curr), len(curr[0])
    pad = lambda rows: torch.cat([torch.zeros(b, 1), torch.tensor(rows, dtype=torch.float32)], dim=1)  # noqa: E731
    zeros = [[0.0] * t for _ in range(b)]
    data = {
        "token_mask": pad([[1.0] * t for _ in range(b)]),
        "sample_mask": torch.ones(b),
        "advantages": pad(adv if adv is not None else zeros),
        "generation_logprobs": pad(gen if gen is not None else curr),
        "reference_policy_logprobs": pad(ref if ref is not None else curr),
    }
    data["prev_logprobs"] = pad(prev if prev is not None else curr)
    if rewards is not None:
        data["rewards"] = torch.tensor(rewards)
    return torch.tensor(curr, dtype=torch.float32, requires_grad=True), data


def _run(cfg, curr, data, seqs=None, toks=None):
    fn = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0, **cfg})
    n_tok = float(data["token_mask"][:, 1:].sum())
    loss, metrics = fn(curr, data, seqs if seqs is not None else float(len(curr)), toks if toks is not None else n_tok)
    loss.backward()
    return loss.item(), curr.grad.tolist(), metrics


def test_kl_gradient_has_the_score_function_term():
    """The issue's case: NeMo-RL's gradient [[-0.0450, 0.0600]] (was [[-0.0525, 0.0495]])."""
    curr, data = _batch([[-1.2, -0.7]], ref=[[-0.9, -1.1]])
    loss, grad, _ = _run({"reference_policy_kl_penalty": 0.3, "reference_policy_kl_type": "k3"}, curr, data)
    logr = [0.3, -0.4]  # ref - curr
    k3 = [E(x) - 1 - x for x in logr]
    assert loss == pytest.approx(0.3 * sum(k3) / 2, rel=1e-6)  # the value is unchanged
    # d/dcurr [w * k3] with w = exp(curr - sg(curr)): k3 + (1 - exp(logr))
    want = [0.3 * (k + 1 - E(x)) / 2 for k, x in zip(k3, logr)]
    assert grad[0] == pytest.approx(want, abs=1e-6)
    assert grad[0] == pytest.approx([-0.0450, 0.0600], abs=5e-5)


def test_on_policy_kl_approximation_clamps_the_weighted_kl():
    """``clamp(w * kl)``: one token, w = e^2, k3 = e^3 - 4 (16.1) > the clamp 10: loss 10, not 73.89."""
    curr, data = _batch([[-4.0]], gen=[[-6.0]], ref=[[-1.0]])
    loss, _, _ = _run({"reference_policy_kl_penalty": 1.0, "use_on_policy_kl_approximation": True}, curr, data)
    assert loss == pytest.approx(10.0, rel=1e-6)
    assert E(2) * 10 == pytest.approx(73.89, abs=0.01)  # what weighting the clamped KL gave


def test_kl_in_reward_takes_the_kl_out_of_the_loss():
    curr, data = _batch([[-1.2, -0.7]], ref=[[-0.9, -1.1]])
    del data["reference_policy_logprobs"]  # not read
    loss, grad, _ = _run({"reference_policy_kl_penalty": 0.3, "use_kl_in_reward": True}, curr, data)
    assert loss == 0.0 and grad == [[0.0, 0.0]]


def test_disable_ppo_ratio_is_reinforce():
    """``L = -A * log pi``: loss sum(-A_t curr_t)/N, gradient -A_t/N."""
    curr, data = _batch([[-1.0, -2.0]], prev=[[-5.0, -5.0]], adv=[[1.0, -0.5]])
    loss, grad, _ = _run({"disable_ppo_ratio": True}, curr, data)
    assert loss == pytest.approx((1.0 * 1.0 + -0.5 * 2.0) / 2)
    assert grad[0] == pytest.approx([-0.5, 0.25])


def test_force_on_policy_ratio_needs_no_prev_logprobs():
    curr, data = _batch([[-1.0, -2.0]], adv=[[2.0, -1.0]])
    del data["prev_logprobs"]
    loss, grad, m = _run({"force_on_policy_ratio": True}, curr, data)
    assert loss == pytest.approx((-2.0 + 1.0) / 2)  # ratio 1
    assert grad[0] == pytest.approx([-1.0, 0.5])  # -A * r / N with r = 1
    assert m["probs_ratio"] == pytest.approx(1.0) and m["probs_ratio_max"] == pytest.approx(1.0)
    assert not ClippedPGLossConfig(force_on_policy_ratio=True).needs_prev_logprobs


def test_clip_higher_and_dual_clip():
    """DAPO's asymmetric clip: r = 1.3, A = 1 -> -1.28; r = 0.7, A = -1 -> 0.8 (clip at 0.8).
    Dual clip c = 3: r = 5, A = -1 -> min(max(5, 1.2), 3) = 3."""
    lr = [math.log(1.3), math.log(0.7), math.log(5.0)]
    curr, data = _batch([lr], prev=[[0.0, 0.0, 0.0]], adv=[[1.0, -1.0, -1.0]])
    loss, grad, m = _run({"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "ratio_clip_c": 3.0}, curr, data)
    assert loss == pytest.approx((-1.28 + 0.8 + 3.0) / 3, rel=1e-5)
    assert grad[0] == pytest.approx([0.0, 0.0, 0.0])  # every token clipped
    assert m["probs_ratio_max"] == pytest.approx(5.0, rel=1e-5) and m["probs_ratio_min"] == pytest.approx(0.7, rel=1e-5)
    assert m["probs_ratio_clamped_max"] == pytest.approx(1.28, rel=1e-5)


def test_gspo_sequence_level_ratio():
    """s = exp(mean_t(curr - prev)) = e^0.1 (inside the clip), sequence-level loss -A s, gradient
    -A s / 2 per token (each token moves the mean by half)."""
    curr, data = _batch([[0.05, 0.15]], prev=[[0.0, 0.0]], adv=[[1.0, 1.0]])
    loss, grad, _ = _run({"sequence_level_importance_ratios": True, "token_level_loss": False}, curr, data)
    s = E(0.1)
    assert loss == pytest.approx(-s, rel=1e-6)
    assert grad[0] == pytest.approx([-s / 2, -s / 2], rel=1e-5)


def test_gspo_sequence_level_importance_weight():
    """w_i = exp(sum_t (prev - gen)) for the whole sequence: e^(0.1 + 0.2)."""
    curr, data = _batch([[0.0, 0.0]], prev=[[0.0, 0.0]], gen=[[-0.1, -0.2]], adv=[[1.0, 1.0]])
    loss, _, m = _run({"sequence_level_importance_ratios": True, "token_level_loss": False,
                       "use_importance_sampling_correction": True}, curr, data)
    assert m["sampling_importance_ratio"] == pytest.approx(E(0.3), rel=1e-6)
    assert loss == pytest.approx(-E(0.3), rel=1e-6)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """CISPO: -A * sg(clip(r)) * log pi; r = 1.5 clips at 1.2 but the token still gets -A*1.2/N
    (PPO would give it 0)."""
    curr, data = _batch([[math.log(1.5), 0.0]], prev=[[0.0, 0.0]], adv=[[1.0, 1.0]])
    loss, grad, _ = _run({"use_cispo": True}, curr, data)
    assert loss == pytest.approx(-(1.2 * math.log(1.5) + 1.0 * 0.0) / 2, rel=1e-6)
    assert grad[0] == pytest.approx([-1.2 / 2, -1.0 / 2], rel=1e-6)
    _, ppo_grad, _ = _run({}, *_batch([[math.log(1.5), 0.0]], prev=[[0.0, 0.0]], adv=[[1.0, 1.0]]))
    assert ppo_grad[0][0] == 0.0


def test_truncated_importance_sampling_variants():
    """IS weights [2.0, 0.5, 1.0] (prev - gen = log w)."""
    w = [2.0, 0.5, 1.0]
    base = dict(prev=[[0.0] * 3], gen=[[-math.log(x) for x in w]], adv=[[1.0] * 3])
    on = {"use_importance_sampling_correction": True}
    # tis: clamp to [0.8, 1.5]; the loss is -sum_t w_t r_t / N with r = 1
    loss, _, m = _run({**on, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.5,
                       "truncated_importance_sampling_ratio_min": 0.8}, *_batch([[0.0] * 3], **base))
    assert loss == pytest.approx(-(1.5 + 0.8 + 1.0) / 3, rel=1e-6) and m["is_oob_ratio"] == pytest.approx(2 / 3)
    # the ratio alone: tis with min 0 (clamp above only)
    loss, _, _ = _run({**on, "truncated_importance_sampling_ratio": 1.5}, *_batch([[0.0] * 3], **base))
    assert loss == pytest.approx(-(1.5 + 0.5 + 1.0) / 3, rel=1e-6)
    # icepop: weights outside [0.6, 1.5] are dropped
    loss, _, m = _run({**on, "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 1.5,
                       "truncated_importance_sampling_ratio_min": 0.6}, *_batch([[0.0] * 3], **base))
    assert loss == pytest.approx(-(0.0 + 0.0 + 1.0) / 3, rel=1e-6) and m["is_oob_ratio"] == pytest.approx(2 / 3)


def test_seq_mask_tis_drops_whole_sequences_by_geometric_mean():
    """Sequence 1: log weights [0, 0.02], geometric mean e^0.01 in [0.999, 1.02]: kept with its raw
    token weights; sequence 2: [0.5, 0.5], e^0.5: all its tokens weigh 0."""
    curr, data = _batch([[0.0, 0.0], [0.0, 0.0]], prev=[[0.0, 0.0], [0.0, 0.0]], gen=[[0.0, -0.02], [-0.5, -0.5]],
                        adv=[[1.0, 1.0], [1.0, 1.0]])
    loss, _, m = _run({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "seq-mask-tis",
                       "truncated_importance_sampling_ratio": 1.02, "truncated_importance_sampling_ratio_min": 0.999},
                      curr, data)
    assert loss == pytest.approx(-(1.0 + E(0.02)) / 4, rel=1e-6)
    assert m["is_oob_ratio"] == pytest.approx(0.5)


def test_positive_example_nll():
    """VAPO: mu * mean NLL of the tokens of samples with reward > 0 (sample 0 here)."""
    curr, data = _batch([[-1.0, -3.0], [-2.0, -2.0]], adv=[[0.0, 0.0], [0.0, 0.0]], rewards=[1.0, 0.0])
    loss, grad, m = _run({"positive_example_nll_weight": 0.5}, curr, data)
    assert m["positive_nll_loss"] == pytest.approx(2.0) and loss == pytest.approx(1.0)
    assert grad[0] == pytest.approx([-0.25, -0.25]) and grad[1] == [0.0, 0.0]


def test_mismatch_metrics():
    """prev = log 0.5, gen = log 0.25 on one token: exp|gen - prev| = 2; KL(gen||old) by k3 with
    logr = ln 2: 1 - ln 2; KL(old||gen): ln 2 - 0.5; JS with M = 0.375."""
    curr, data = _batch([[math.log(0.5)]], prev=[[math.log(0.5)]], gen=[[math.log(0.25)]])
    _, _, m = _run({}, curr, data)
    assert m["token_mult_prob_error"] == pytest.approx(2.0, rel=1e-6)
    assert m["gen_kl_error"] == pytest.approx(1 - math.log(2), rel=1e-5)
    assert m["policy_kl_error"] == pytest.approx(math.log(2) - 0.5, rel=1e-5)
    k3 = lambda x: math.exp(x) - x - 1  # noqa: E731
    js = 0.5 * k3(math.log(0.5 / 0.375)) + 0.5 * k3(math.log(0.25 / 0.375))
    assert m["js_divergence_error"] == pytest.approx(js, rel=1e-5)
    assert m["sampling_importance_ratio"] == pytest.approx(2.0, rel=1e-6)  # 0.5 / 0.25


@pytest.mark.parametrize("cfg,keys", [
    ({"use_cispo": True, "disable_ppo_ratio": True}, ("use_cispo", "disable_ppo_ratio")),
    ({"use_cispo": True, "ratio_clip_c": 3.0}, ("use_cispo", "ratio_clip_c")),
    ({"disable_ppo_ratio": True, "force_on_policy_ratio": True}, ("disable_ppo_ratio", "force_on_policy_ratio")),
    ({"sequence_level_importance_ratios": True}, ("sequence_level_importance_ratios", "token_level_loss")),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 1.5,
      "truncated_importance_sampling_ratio_min": 2.0}, ("truncated_importance_sampling_ratio_min", "truncated_importance_sampling_ratio")),
    ({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
      "truncated_importance_sampling_ratio": 1.5}, ("icepop", "truncated_importance_sampling_ratio_min")),
    ({"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.5},
     ("truncated_importance_sampling", "use_importance_sampling_correction")),
])
def test_invalid_combinations_name_the_keys(cfg, keys):
    with pytest.raises(ValidationError) as ei:
        ClippedPGLossConfig(**cfg)
    for k in keys:
        assert k in str(ei.value), (k, str(ei.value))


def test_dr_grpo_constant_length_normalisation():
    """Two sequences of 1 and 3 tokens, A = 1, r = 1: sum of -A r over 4 tokens = -4, divided by
    seqs * L = 2 * 8 (not by the 4 tokens); each token's gradient -1/16 whatever its sequence's length."""
    curr, data = _batch([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], adv=[[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    data["token_mask"][0, 2:] = 0.0  # sequence 0 has one response token
    loss, grad, _ = _run({"constant_length_normalization": 8}, curr, data, seqs=2.0)
    assert loss == pytest.approx(-4 / 16)
    assert grad[0] == pytest.approx([-1 / 16, 0.0, 0.0]) and grad[1] == pytest.approx([-1 / 16] * 3)


def test_dr_grpo_advantages_have_no_std_division():
    import torch as t

    from flows.config import load_config
    from nrl_tasks.stages.advantages import compute_advantages
    from tests.fixtures.grpo_runs import TINY_CONFIG

    cfg = load_config(TINY_CONFIG, ["grpo.adv_estimator.name=dr_grpo"])
    out = compute_advantages(t.tensor([0, 0, 0, 0]), t.tensor([1.0, 0.0, 0.0, 0.0]), t.ones(4, dtype=t.bool), cfg.grpo,
                             loss_cfg=cfg.loss_fn)
    assert out["advantages"].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
