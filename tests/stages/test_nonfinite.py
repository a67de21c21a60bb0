"""Non-finite values (issue 14): extreme rewards are masked and counted like NaN, advantages of
huge rewards stay finite, a NaN/inf train step is not an actor fault (also through Ray), and a
non-finite figure reaches the manifest as null instead of failing the commit."""

from __future__ import annotations


import pickle
import types

import pytest
import torch

from nrl_tasks.config.grpo import GRPOConfig
from nrl_tasks.stages.errors import (
    NonFiniteTrainingError,
    is_actor_fault,
    nonfinite_training_error,
    policy_weights_invalid,
)

EXTREME = [1.0, float("nan"), float("inf"), 1e39, -1e39, 1e30]
EXTREME_VALID = [True, False, False, False, False, True]


def extreme_rewards(prompts, responses, answers):
    """Reward plug-in for the score stage: NaN, inf and beyond-float32 values, then repeat."""
    return [EXTREME[i % len(EXTREME)] for i in range(len(prompts))]


def test_safe_rewards_masks_non_finite_and_beyond_float32_like_nan():
    from nrl_tasks.environments.rewards import safe_rewards

    n = len(EXTREME)
    rewards, valid, errors = safe_rewards(lambda p, r, a: list(EXTREME), ["p"] * n, ["r"] * n, ["a"] * n)
    assert valid.tolist() == EXTREME_VALID
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, pytest.approx(1e30)]
    assert len(errors) == 1 and "4 of 6" in errors[0] and "[1, 2, 3, 4]" in errors[0]
    # the same through a tensor and numpy / int values beyond float32 (and beyond float64)
    import numpy as np

    odd = [np.float64(1e39), 10**40, 10**400, torch.tensor(2.0, dtype=torch.float64), np.float32(3.0), -3.4e38]
    rewards, valid, _ = safe_rewards(lambda p, r, a: odd, ["p"] * 6, ["r"] * 6, ["a"] * 6)
    assert valid.tolist() == [False, False, False, True, True, True]
    assert torch.isfinite(rewards).all()


def test_score_stage_masks_and_counts_extreme_rewards(tmp_path):
    """The ``score`` stage on persisted rollouts: no exception, masked and counted like NaN."""
    import storage
    from flows.config import load_config
    from flows.run.runtime import build_run_context
    from nrl_tasks.run_layout import RunLayout
    from nrl_tasks.stages.runner import committed_ref
    from nrl_tasks.stages.score import score
    from tests.flows.conftest import TINY_CONFIG

    root = str(tmp_path / "runs")
    cfg = load_config(TINY_CONFIG, [f"storage.root={root}", f"env.reward_fn={__name__}:extreme_rewards"])
    layout = RunLayout(root, "extreme-rewards")
    storage.save_batch(
        {
            "prompt": ["What is 1+1? Answer:"] * 6 + ["What is 2+2? Answer:"] * 6,
            "response": [" 2"] * 12,
            "answer": ["2"] * 6 + ["4"] * 6,
            "group_id": torch.tensor([0] * 6 + [1] * 6),
        },
        layout.stage_uri(1, "rollouts"), run_id="extreme-rewards", step=1, stage="rollouts",
    )
    no_actors = types.SimpleNamespace(namespace="-", policy=None, generation=None, reward_model=None)
    ctx = build_run_context(cfg, "extreme-rewards", no_actors, tokenizer=None).step(1)
    out = score.fn(ctx, committed_ref(layout.stage_uri(1, "rollouts"))).summary()
    rewards = storage.load_batch(layout.stage_uri(1, "rewards"))
    assert rewards["reward_valid"].tolist() == EXTREME_VALID * 2
    assert torch.isfinite(rewards["rewards"]).all()
    assert out["invalid_rewards"] == 8 and "8 of 12 rewards invalid" in out["reward_errors"]
    meta = storage.read_manifest(layout.stage_uri(1, "rewards")).meta
    assert meta["invalid_rewards"] == 8 and meta["reward_mean"] == pytest.approx(5e29, rel=1e-6)


@pytest.mark.parametrize("loo", [True, False], ids=["leave_one_out", "group_mean"])
def test_advantages_of_huge_finite_rewards_stay_finite(loo):
    """Rewards near float32's limits: float32 ``r - baseline`` and ``std`` used to overflow."""
    from nrl_tasks.stages.advantages import compute_advantages

    grpo = GRPOConfig(use_leave_one_out_baseline=loo, normalize_rewards=True)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    r = torch.tensor([3e38, -3e38, 1.0, 1e30, 0.0, 1.0], dtype=torch.float32)
    adv = compute_advantages(groups, r, torch.ones(6, dtype=torch.bool), grpo)
    assert torch.isfinite(adv["advantages"]).all(), adv["advantages"]
    # ordinary rewards: the float64 arithmetic rounds to the float32 result
    plain = compute_advantages(torch.tensor([0, 0, 0, 0]), torch.tensor([1.0, 0.0, 0.5, 0.0]), torch.ones(4), grpo)
    assert torch.isfinite(plain["advantages"]).all() and plain["advantages"].dtype == torch.float32


def test_nonfinite_training_error_is_not_an_actor_fault_also_through_ray():
    import ray.exceptions as rx

    err = NonFiniteTrainingError(
        "non-finite grad_norm", what="grad_norm", value=float("inf"), weights_version=3, global_batch=0,
        parameter="model.embed_tokens.weight", rank=1, weights_valid=True,
    )
    assert not is_actor_fault(err)
    # the worker's exception travels pickled; its fields survive
    back = pickle.loads(pickle.dumps(err))
    assert (back.what, back.parameter, back.weights_version, back.rank, back.weights_valid) == (
        "grad_norm", "model.embed_tokens.weight", 3, 1, True
    )
    # what ray.get raises for an actor method that raised it: a RayTaskError that is also one
    wrapped = rx.RayTaskError("PolicyWorker.train", "Traceback ...", back).as_instanceof_cause()
    assert isinstance(wrapped, rx.RayTaskError) and isinstance(wrapped, NonFiniteTrainingError)
    assert not is_actor_fault(wrapped)
    assert nonfinite_training_error(wrapped).what == "grad_norm"
    assert not policy_weights_invalid(wrapped)
    # chained under another error (a stage re-raising), and a broken-weights one
    broken = NonFiniteTrainingError("param nan", what="parameter", parameter="lm_head.weight", weights_valid=False)
    try:
        try:
            raise rx.RayTaskError("PolicyWorker.train", "tb", broken).as_instanceof_cause()
        except Exception as inner:
            raise RuntimeError("train of step 3 failed") from inner
    except RuntimeError as outer:
        assert not is_actor_fault(outer)
        assert policy_weights_invalid(outer)
    # a real actor fault stays one
    assert is_actor_fault(rx.RayActorError())


def test_non_finite_figures_are_recorded_as_null(tmp_path, caplog):
    """``storage`` refuses NaN/inf in a manifest; the train/advantages figures drop them to null."""
    import storage
    from nrl_tasks.stages.train import finite_or_none

    figures = finite_or_none({"loss": float("nan"), "grad_norm": float("inf"), "tokens_per_s": 12.5, "x": None}, "t")
    assert figures == {"loss": None, "grad_norm": None, "tokens_per_s": 12.5, "x": None}
    assert "recorded as null" in caplog.text
    storage.save_batch({"step": torch.tensor([1])}, str(tmp_path / "d"), run_id="r", step=1, stage="train", **figures)
    assert storage.read_manifest(str(tmp_path / "d")).meta["grad_norm"] is None


class _LocalPolicy:
    """What the train stage needs of a ``Policy``, over a real one-rank worker in this process."""

    def __init__(self, worker):
        self.worker = worker
        self.worker_group = types.SimpleNamespace(workers=[])

    @property
    def weights_version(self) -> int:
        return self.worker.weights_version

    def train(self, data, loss_fn, gbs=None, mbs=None):
        return self.worker.train(data, loss_fn, gbs=gbs, mbs=mbs)

    def weights_checksum(self) -> str:
        return self.worker.weights_checksum()


def test_train_stage_with_a_nan_advantage_commits_nothing(tmp_path, tiny_model_dir):
    """Real torch training through the ``train`` stage: the guard raises before the optimizer
    step, nothing is committed, the failure is recorded, the weights are unchanged."""
    import storage
    from flows.config import load_config
    from flows.run.runtime import build_run_context
    from nrl_tasks.models.policy import PolicyConfig
    from nrl_tasks.run_layout import RunLayout
    from nrl_tasks.stages.runner import committed_ref
    from nrl_tasks.stages.train import train
    from tests.flows.conftest import TINY_CONFIG
    from nrl_tasks.models.policy.workers.in_process import in_process_worker
    from tests.models.policy.helpers import make_batch

    root = str(tmp_path / "runs")
    cfg = load_config(TINY_CONFIG, [f"storage.root={root}"])
    gbs, mbs = cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size
    layout, run_id = RunLayout(root, "nan-train"), "nan-train"
    b = make_batch(gbs, 24, seed=9)
    adv = b["advantages"][:, 0].clone()
    adv[gbs - 1] = float("nan")
    parts = {
        "rollouts": {k: b[k] for k in ("input_ids", "input_lengths", "token_mask", "generation_logprobs")},
        "logprobs": {"prev_logprobs": b["prev_logprobs"], "reference_policy_logprobs": b["reference_policy_logprobs"]},
        "advantages": {"advantages": adv, "sample_mask": torch.ones(gbs)},
    }
    for stage, cols in parts.items():
        storage.save_batch(cols, layout.stage_uri(1, stage), run_id=run_id, step=1, stage=stage)
    pcfg = PolicyConfig(model_name=tiny_model_dir, train_global_batch_size=gbs, train_micro_batch_size=mbs)
    with in_process_worker(pcfg) as worker:
        before = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
        actors = types.SimpleNamespace(namespace="-", policy=_LocalPolicy(worker), generation=None, reward_model=None)
        ctx = build_run_context(cfg, run_id, actors, tokenizer=None).step(1)
        refs = [committed_ref(layout.stage_uri(1, s)) for s in ("rollouts", "logprobs", "advantages")]
        with pytest.raises(NonFiniteTrainingError, match="non-finite loss") as info:
            train.fn(ctx, *refs)
        assert info.value.weights_valid and not is_actor_fault(info.value)
        assert not storage.is_committed(layout.stage_uri(1, "train"))
        assert ctx.run.last_failure == (1, "train")
        assert worker.weights_version == 0
        for k, v in worker.model.state_dict().items():
            assert torch.equal(v, before[k]), k
