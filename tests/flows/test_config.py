"""Config: YAML + dotted overrides, one clear error for unknown keys / wrong types / impossible combinations, hash."""

from __future__ import annotations

import os

import pytest
import yaml

from flows.config import ConfigError, config_hash, config_to_yaml, load_config, redact, saved_config_hash
from flows.algorithms.grpo import GRPO
from flows.config.overrides import apply_overrides, parse_value

TINY = "configs/grpo_tiny.yaml"


def test_tiny_config_loads_with_nemo_rl_keys():
    cfg = load_config(TINY)
    assert cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt == cfg.rollout_batch_size == 16
    assert cfg.policy.model_name == "builtin:tiny"
    assert cfg.loss_fn.reference_policy_kl_penalty == 0.01
    assert cfg.checkpointing.save_period == 2


def test_overrides_apply_and_parse_types():
    cfg = load_config(TINY, ["grpo.max_num_steps=7", "policy.optimizer.kwargs.lr=5e-6", "logger.console=false"])
    assert cfg.grpo.max_num_steps == 7 and cfg.policy.optimizer.kwargs.lr == 5e-6 and cfg.logger.console is False
    assert parse_value("[1, 2]") == [1, 2] and parse_value("abc") == "abc" and parse_value("-3") == -3
    with pytest.raises(ValueError, match="not of the form key=value"):
        apply_overrides({}, ["grpo.max_num_steps"])
    with pytest.raises(ValueError, match="grpo.max_num_steps is a int, not a section"):
        apply_overrides({"grpo": {"max_num_steps": 3}}, ["grpo.max_num_steps.x=1"])


def test_unknown_keys_and_wrong_types_reported_together():
    with pytest.raises(ConfigError) as ei:
        load_config(TINY, ["grpo.num_prompts_per_stepp=3", "policy.train_global_batch_size=abc", "foo=1"])
    msg = str(ei.value)
    assert "grpo.num_prompts_per_stepp: unknown key" in msg
    assert "policy.train_global_batch_size" in msg and "'abc'" in msg
    assert "foo: unknown key" in msg
    assert msg.count("\n  - ") == 3  # one error listing all three problems


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["policy.train_global_batch_size=12", "policy.train_micro_batch_size=4"], "16 is not a multiple of policy.train_global_batch_size = 12"),
        (["policy.train_micro_batch_size=3"], "not a multiple of policy.train_micro_batch_size"),
        (["generation.max_new_tokens=64"], "leaves no room for the prompt"),
        (["grpo.num_generations_per_prompt=1"], "grpo.num_generations_per_prompt"),
        (["env.reward_fn=notapath"], "package.module:function"),
        (["data.dataset=file"], "data.train_path is required"),
        (["generation.backend=vllm"], "needs cluster.gpus_per_node >= 1"),
    ],
)
def test_impossible_combinations(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        load_config(TINY, overrides)


def test_missing_or_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot be read as YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping at top level"):
        load_config(lst)


def test_hash_covers_results_not_placement():
    base = load_config(TINY)
    h = config_hash(base)
    assert config_hash(load_config(TINY, ["storage.root=/elsewhere", "logger.console=false", "grpo.max_num_steps=50"])) == h
    assert config_hash(load_config(TINY, ["cluster.ray.address=10.0.0.1:6379", "checkpointing.save_period=5"])) == h
    assert config_hash(load_config(TINY, ["policy.optimizer.kwargs.lr=1e-5"])) != h
    assert config_hash(load_config(TINY, ["grpo.seed=1"])) != h
    assert config_hash(load_config(TINY, ["generation.temperature=0.7"])) != h
    # a warm start counts only when on (a run without one hashes as before the key existed)
    assert config_hash(load_config(TINY, ["warm_start.batch_size=8"])) == h
    assert config_hash(load_config(TINY, ["warm_start.sft_steps=10"])) != h
    # a DPO run, like a GRPO run, can be extended: its length is not in the hash
    dpo = os.path.join(os.path.dirname(TINY), "dpo_tiny.yaml")
    assert config_hash(load_config(dpo, ["dpo.max_num_steps=99"])) == config_hash(load_config(dpo))
    assert config_hash(load_config(dpo, ["dpo.reference_policy_kl_penalty=0.3"])) != config_hash(load_config(dpo))


def test_saved_yaml_roundtrip_and_redaction():
    with pytest.raises(ConfigError, match="storage.storage_options.key looks like a credential"):
        load_config(TINY, ["storage.storage_options.key=AKIA_SECRET"])  # credentials come from the environment
    cfg = load_config(TINY, ["storage.storage_options.client_kwargs.endpoint_url=http://x"])
    text = config_to_yaml(cfg)
    assert "http://x" in text
    assert saved_config_hash(text) == config_hash(cfg)
    data = yaml.safe_load(text)
    data["storage"] = {"root": "./runs"}
    assert config_hash(load_config(data)) == config_hash(cfg)
    assert redact([{"token": "t"}]) == [{"token": "***"}]


def test_policy_config_fills_generation_and_resolves_builtin(tmp_path, monkeypatch):
    monkeypatch.setenv("NRL_MODEL_CACHE", str(tmp_path))
    cfg = load_config(TINY, ["generation.temperature=0.5"])
    pc = cfg.policy_config()
    assert pc.generation is not None and pc.generation.temperature == 0.5 and pc.temperature == 0.5
    assert pc.model_name == str(tmp_path / "tiny-seed0") and (tmp_path / "tiny-seed0" / "config.json").is_file()
    assert cfg.generation_config().model_name == pc.model_name
    assert cfg.max_prompt_tokens() == 64 - 8


def test_lora_with_the_vllm_backend_switches_on_vllm_lora(tmp_path, monkeypatch):
    """LoRA + vLLM: the generation workers get vLLM's LoRA switches (the adapters-only refits need
    them); keys the user set in llm_kwargs win; without LoRA or with the HF backend none are added."""
    monkeypatch.setenv("NRL_MODEL_CACHE", str(tmp_path))
    lora = ["policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.dim=4", "cluster.gpus_per_node=1"]
    gen = load_config("configs/grpo_tiny_lora.yaml", ["generation.backend=vllm", *lora]).generation_config()
    assert gen.vllm_cfg.llm_kwargs == {"enable_lora": True, "max_lora_rank": 4, "max_loras": 1}
    own = load_config(TINY, ["generation.backend=vllm", *lora, 'generation.vllm_cfg.llm_kwargs={"max_lora_rank": 64}'])
    assert own.generation_config().vllm_cfg.llm_kwargs["max_lora_rank"] == 64
    assert load_config(TINY, [*lora]).generation_config().vllm_cfg.llm_kwargs == {}
    assert load_config(TINY, ["generation.backend=vllm", "cluster.gpus_per_node=1"]).generation_config().vllm_cfg.llm_kwargs == {}


def test_stage_retry_keys_from_yaml_and_overrides(tmp_path):
    """``grpo.stage_retries`` / ``grpo.stage_retry_delay_s``: defaults from the stage errors module, set
    from YAML or ``key=value``, validated, turned into the flow's retry budget, and outside the config
    hash (a resume may change them)."""
    from flows.run.recovery import RetryBudget
    from nrl_tasks.stages.errors import DEFAULT_STAGE_RETRIES, DEFAULT_STAGE_RETRY_DELAY_S

    base = load_config(TINY)
    assert base.grpo.stage_retries == DEFAULT_STAGE_RETRIES == 2
    assert base.grpo.stage_retry_delay_s == list(DEFAULT_STAGE_RETRY_DELAY_S) == [1.0, 3.0]

    cfg = load_config(TINY, ["grpo.stage_retries=0", "grpo.stage_retry_delay_s=[0.5, 2, 8]"])
    assert cfg.grpo.stage_retries == 0 and cfg.grpo.stage_retry_delay_s == [0.5, 2.0, 8.0]
    data = yaml.safe_load(open(TINY))
    data["grpo"].update(stage_retries=5, stage_retry_delay_s=[0])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    from_yaml = load_config(path)
    assert from_yaml.grpo.stage_retries == 5 and from_yaml.grpo.stage_retry_delay_s == [0.0]
    assert config_hash(cfg) == config_hash(from_yaml) == config_hash(base)

    assert RetryBudget.for_run(cfg, GRPO).take(1, "train") is None  # no retry at all
    budget = RetryBudget.for_run(base, GRPO)
    assert [budget.take(3, "train") for _ in range(3)] == [1.0, 3.0, None]  # then the step fails
    assert budget.take(3, "generate") == 1.0  # each stage of each step has its own budget
    five = RetryBudget.for_run(from_yaml, GRPO)
    assert [five.take(1, "logprob") for _ in range(6)] == [0.0] * 5 + [None]  # the last delay repeats

    for overrides, needle in (
        (["grpo.stage_retries=-1"], "grpo.stage_retries"),
        (["grpo.stage_retry_delay_s=[1, -0.5]"], r"grpo.stage_retry_delay_s: retry delays must be >= 0 seconds, got -0.5"),
        (["grpo.stage_retry_delay_s=fast"], "grpo.stage_retry_delay_s"),
        (["grpo.refit.retry_delay_s=[-1]"], "grpo.refit.retry_delay_s: retry delays must be >= 0"),
    ):
        with pytest.raises(ConfigError, match=needle):
            load_config(TINY, overrides)
    with pytest.raises(ConfigError, match="at most 50 retry delays"):
        load_config(TINY, ["grpo.stage_retry_delay_s=[" + ",".join(["1"] * 51) + "]"])
