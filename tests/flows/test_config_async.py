"""``grpo.async_grpo`` (NeMo-RL's keys): async needs the importance-sampling correction, in-flight
weight updates are refused, and a synchronous config hashes as before the section existed."""

from __future__ import annotations

import pytest

from tests.flows.conftest import TINY_CONFIG


def test_async_needs_the_importance_sampling_correction():
    from flows.config import ConfigError, load_config

    with pytest.raises(ConfigError) as ei:
        load_config(TINY_CONFIG, ["grpo.async_grpo.enabled=true"])
    assert "grpo.async_grpo.enabled" in str(ei.value) and "loss_fn.use_importance_sampling_correction" in str(ei.value)
    cfg = load_config(TINY_CONFIG, ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"])
    assert cfg.grpo.async_grpo.max_trajectory_age_steps == 1


def test_in_flight_weight_updates_are_refused():
    from flows.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="in_flight_weight_updates is not implemented"):
        load_config(TINY_CONFIG, ["grpo.async_grpo.in_flight_weight_updates=true"])


def test_a_sync_config_hashes_as_before_and_async_changes_the_hash():
    from flows.config import config_hash, load_config

    sync = load_config(TINY_CONFIG)
    assert config_hash(sync) == "d694865e842f5e20"  # the hash of configs/grpo_tiny.yaml before async_grpo existed
    on = load_config(TINY_CONFIG, ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"])
    assert config_hash(on) != config_hash(sync)
