"""The environment's config keys: hashes of runs without them unchanged, clear refusals."""

from __future__ import annotations

import os

import pytest

from flows.config import ConfigError, config_hash, load_config

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "grpo_tiny.yaml")
MT = ["env.environment=guess_number", "grpo.max_rollout_turns=4"]


def test_single_turn_runs_keep_their_hash_and_the_environment_keys_count_when_used():
    base = config_hash(load_config(TINY))
    assert config_hash(load_config(TINY, ["grpo.max_rollout_turns=1", "env.num_workers=1"])) == base
    mt = config_hash(load_config(TINY, MT))
    assert mt != base
    assert config_hash(load_config(TINY, [*MT, "env.num_workers=4"])) == mt  # where it runs, not what it answers
    assert config_hash(load_config(TINY, [*MT, "env.environment_kwargs={decay: 0.5}"])) != mt
    assert config_hash(load_config(TINY, [*MT[:1], "grpo.max_rollout_turns=2"])) != mt


@pytest.mark.parametrize("overrides, needle", [
    (["grpo.max_rollout_turns=2"], "needs env.environment"),
    (["env.environment=calculator", "env.reward_fn=nrl_tasks.environments.arithmetic:exact_match_reward"],
     "env.environment rewards the episodes itself"),
    (["env.num_workers=0"], "env.num_workers"),
])
def test_bad_combinations_are_refused_naming_the_keys(overrides, needle):
    with pytest.raises((ConfigError, ValueError), match=needle.replace(".", r"\.")):
        load_config(TINY, overrides)


def test_the_built_in_environments_have_their_prompts():
    from nrl_tasks.stages.data import load_prompt_records

    for name in ("calculator", "guess_number"):
        cfg = load_config(TINY, [f"data.dataset={name}", f"env.environment={name}", "data.arithmetic.max_operand=999"])
        recs = load_prompt_records(cfg.data, "train", cfg.grpo.seed)
        assert len(recs) == cfg.data.arithmetic.num_train and all(r["answer"].lstrip("-").isdigit() for r in recs)
