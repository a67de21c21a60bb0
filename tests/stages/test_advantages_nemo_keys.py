"""NeMo-RL's GRPO keys on advantages and rewards (issue 42, item 2): ``grpo.advantage_clip_low`` /
``advantage_clip_high`` clamp the normalised advantages, ``grpo.overlong_filtering`` keeps truncated
samples in their group's baseline but out of the loss, ``grpo.reward_scaling`` maps the valid
rewards before anything else reads them."""

from __future__ import annotations

import pytest
import torch

from flows.config import ConfigError, load_config
from nrl_tasks.stages.advantages import compute_advantages
from nrl_tasks.stages.score import scale_rewards
from tests.flows.conftest import TINY_CONFIG

GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
VALID = torch.ones(8)


def _adv(*overrides, truncated=None):
    cfg = load_config(TINY_CONFIG, list(overrides))
    return compute_advantages(GROUPS, REWARDS, VALID, cfg.grpo, truncated=truncated)


def test_advantage_clip_clamps_after_normalisation():
    free = _adv()["advantages"]
    assert free.max() > 0.8 and free.min() < -0.5  # the lone success and failure stand out
    clipped = _adv("grpo.advantage_clip_low=-0.5", "grpo.advantage_clip_high=0.8")["advantages"]
    assert torch.equal(clipped, free.clamp(-0.5, 0.8)) and not torch.equal(clipped, free)


def test_overlong_filtering_masks_truncated_samples_but_keeps_them_in_the_baseline():
    truncated = torch.tensor([False, True, False, False, False, False, True, False])
    plain = _adv(truncated=truncated)
    filtered = _adv("grpo.overlong_filtering=true", truncated=truncated)
    assert plain["sample_mask"].tolist() == [1.0] * 8
    assert filtered["sample_mask"].tolist() == [1, 0, 1, 1, 1, 1, 0, 1]
    assert torch.equal(filtered["advantages"], plain["advantages"])  # the baseline still counts them
    with pytest.raises(ValueError, match="truncated column"):
        _adv("grpo.overlong_filtering=true")


def test_reward_scaling_clamps_then_maps_and_bad_ranges_are_refused():
    cfg = load_config(TINY_CONFIG, ["grpo.reward_scaling.enabled=true", "grpo.reward_scaling.source_max=10",
                                    "grpo.reward_scaling.target_min=-1", "grpo.reward_scaling.target_max=1"])
    out = scale_rewards(torch.tensor([-3.0, 0.0, 5.0, 10.0, 12.0]), cfg.grpo.reward_scaling)
    assert out.tolist() == [-1.0, -1.0, 0.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="source_max"):
        load_config(TINY_CONFIG, ["grpo.reward_scaling.enabled=true", "grpo.reward_scaling.source_max=0"])
    with pytest.raises(ConfigError, match="advantage_clip_low"):
        load_config(TINY_CONFIG, ["grpo.advantage_clip_low=2", "grpo.advantage_clip_high=1"])


def test_new_keys_at_their_defaults_keep_old_runs_hashes():
    from nrl_tasks.config.hash import config_hash

    base = load_config(TINY_CONFIG)
    same = load_config(TINY_CONFIG, ["grpo.val_at_end=false", "grpo.overlong_filtering=false", "env.step_timeout_s=5"])
    assert config_hash(base) == config_hash(same)
    assert config_hash(base) != config_hash(load_config(TINY_CONFIG, ["grpo.advantage_clip_high=1.0"]))


def test_val_at_end_validates_the_last_step_only():
    from flows.algorithms.grpo import GRPO

    cfg = load_config(TINY_CONFIG, ["grpo.max_num_steps=5", "grpo.val_period=0", "grpo.val_at_end=true"])
    assert [s for s in range(6) if GRPO.validation_due(cfg, s)] == [5]
    off = load_config(TINY_CONFIG, ["grpo.max_num_steps=5", "grpo.val_period=0"])
    assert [s for s in range(6) if GRPO.validation_due(off, s)] == []
