"""Config of the algorithm menu: NeMo-RL's keys, invalid combinations refused naming the keys,
``data.train_path`` never silently ignored, old runs' config hash unchanged."""

from __future__ import annotations

import pytest

from flows.config import config_hash, load_config
from flows.config.io import ConfigError
from tests.fixtures.grpo_runs import TINY_CONFIG


def test_new_keys_at_their_defaults_keep_the_config_hash():
    assert config_hash(load_config(TINY_CONFIG)) == "d694865e842f5e20"
    assert config_hash(load_config(TINY_CONFIG, ["loss_fn.use_cispo=true"])) != "d694865e842f5e20"
    assert config_hash(load_config(TINY_CONFIG, ["grpo.adv_estimator.name=reinforce_plus_plus"])) != "d694865e842f5e20"


def test_kl_in_reward_needs_reinforce_plus_plus():
    with pytest.raises(ConfigError) as ei:
        load_config(TINY_CONFIG, ["loss_fn.use_kl_in_reward=true"])
    assert "loss_fn.use_kl_in_reward" in str(ei.value) and "grpo.adv_estimator.name" in str(ei.value)
    load_config(TINY_CONFIG, ["loss_fn.use_kl_in_reward=true", "grpo.adv_estimator.name=reinforce_plus_plus"])


def test_loss_combination_errors_name_the_keys():
    with pytest.raises(ConfigError) as ei:
        load_config(TINY_CONFIG, ["loss_fn.use_cispo=true", "loss_fn.disable_ppo_ratio=true"])
    assert "use_cispo" in str(ei.value) and "disable_ppo_ratio" in str(ei.value)


def test_train_path_implies_the_file_dataset_or_is_refused(tmp_path):
    import yaml

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with open(TINY_CONFIG, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    data["data"].pop("dataset")
    data["data"]["train_path"] = str(f)
    assert load_config(data).data.dataset == "file"
    with pytest.raises(ConfigError) as ei:
        load_config(TINY_CONFIG, [f"data.train_path={f}"])  # the config says dataset: arithmetic
    assert "data.train_path" in str(ei.value) and "data.dataset" in str(ei.value)


def test_flow_refuses_a_reward_fn_that_does_not_import_before_anything_starts(tmp_path):
    from flows.algorithms.grpo import grpo

    root = tmp_path / "runs"
    with pytest.raises(ValueError, match="env.reward_fn: .*no_such_module"):
        grpo.fn(config=TINY_CONFIG, run_id="bad-reward", storage=str(root), overrides=["env.reward_fn=no_such_module:f"])
    assert not (root / "bad-reward").exists()  # no run directory, no lease, no Ray


def test_dynamic_sampling_keys_and_their_combinations():
    assert config_hash(load_config(TINY_CONFIG, ["grpo.dynamic_sampling_max_gen_batches=10"])) == "d694865e842f5e20"
    cfg = load_config(TINY_CONFIG, ["grpo.use_dynamic_sampling=true", "grpo.batch_multiplier=3"])
    assert cfg.grpo.batch_multiplier == 3 and config_hash(cfg) != "d694865e842f5e20"
    with pytest.raises(ConfigError) as ei:
        load_config(TINY_CONFIG, ["grpo.batch_multiplier=2"])
    assert "grpo.batch_multiplier" in str(ei.value) and "grpo.use_dynamic_sampling" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        load_config(TINY_CONFIG, [
            "grpo.use_dynamic_sampling=true", "grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true",
        ])
    assert "grpo.use_dynamic_sampling" in str(ei.value) and "grpo.async_grpo.enabled" in str(ei.value)
    with pytest.raises(ConfigError, match="dynamic_sampling_max_gen_batches"):
        load_config(TINY_CONFIG, ["grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=0"])


def test_recompute_of_sampled_datasets_is_refused_with_dynamic_sampling():
    from flows.algorithms.grpo import check_recompute_config

    cfg = load_config(TINY_CONFIG, ["grpo.use_dynamic_sampling=true"])
    with pytest.raises(ValueError, match=r"--recompute rewards@2.*grpo.use_dynamic_sampling"):
        check_recompute_config([("logprobs", 1), ("rewards", 2)], cfg)
    check_recompute_config([("logprobs", 1), ("advantages", 2)], cfg)
    check_recompute_config([("rewards", 2)], load_config(TINY_CONFIG))
