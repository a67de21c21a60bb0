"""Config values: finite floats, no booleans for numbers, sane maxima, all in one error naming each
key (issue 14, items 1, 2 and 5). Nothing here starts Ray or Prefect."""

from __future__ import annotations

import glob
import os

import pytest

from flows.config import ConfigError, load_config
from tests.flows.conftest import TINY_CONFIG


def _problems(overrides: list[str], source: str = TINY_CONFIG) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    return str(info.value)


# --------------------------------------------------------------------------- finite floats
@pytest.mark.parametrize(
    "override",
    [
        "policy.optimizer.kwargs.lr=.inf",
        "policy.optimizer.kwargs.lr=inf",  # a string pydantic would read as a float
        "policy.optimizer.kwargs.lr=.nan",
        "policy.optimizer.kwargs.eps=1e999",
        "policy.optimizer.kwargs.weight_decay=.inf",
        "policy.optimizer.kwargs.betas=[0.9, .nan]",
        "policy.max_grad_norm=.inf",
        "policy.dist_timeout_s=.inf",
        "generation.temperature=.inf",
        "generation.vllm_cfg.llm_kwargs.swap_space=.inf",  # free-form dict
        "loss_fn.reference_policy_kl_penalty=.inf",
        "loss_fn.ratio_clip_max=.nan",
        "grpo.refit.timeout_s=.inf",
        "grpo.stage_retry_delay_s=[1, .inf]",
        "storage.retry.max_delay_s=.inf",
        "cluster.num_cpus_per_worker=.inf",
        "cluster.ray.policy_resources.node_a=.inf",
    ],
)
def test_non_finite_floats_are_rejected_naming_the_key(override):
    key = override.split("=")[0]
    msg = _problems([override])
    assert msg.count("\n  - ") == 1 and f"  - {key}" in msg and "finite" in msg, msg


def test_non_finite_float_in_the_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(open(TINY_CONFIG).read().replace("lr: 1.0e-3", "lr: .inf"))
    assert "policy.optimizer.kwargs.lr: must be a finite number (got inf)" in _problems([], str(path))


# --------------------------------------------------------------------------- booleans are not numbers
@pytest.mark.parametrize(
    "override, kind",
    [
        ("grpo.max_num_steps=true", "an integer"),  # ran 1 step
        ("grpo.num_prompts_per_step=true", "an integer"),
        ("data.arithmetic.num_train=false", "an integer"),
        ("generation.num_workers=true", "an integer"),
        ("generation.top_k=true", "an integer"),
        ("policy.train_global_batch_size=true", "an integer"),
        ("policy.optimizer.kwargs.lr=true", "a number"),
        ("generation.temperature=true", "a number"),
        ("loss_fn.reference_policy_kl_penalty=false", "a number"),
        ("grpo.refit.retry_delay_s=[1, true]", "a number"),
        ("cluster.num_cpus_per_worker=true", "a number"),
    ],
)
def test_booleans_are_not_numbers(override, kind):
    key, value = override.split("=")
    if value.startswith("["):
        key += ".1"
    msg = _problems([override])
    assert f"  - {key}: must be {kind}, not a boolean" in msg, msg


def test_boolean_in_the_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(open(TINY_CONFIG).read().replace("max_num_steps: 3", "max_num_steps: yes"))
    assert "grpo.max_num_steps: must be an integer, not a boolean (got True)" in _problems([], str(path))


# --------------------------------------------------------------------------- maxima
@pytest.mark.parametrize(
    "override",
    [
        "grpo.num_prompts_per_step=1e8",
        "grpo.num_prompts_per_step=100000000",
        "grpo.num_generations_per_prompt=4096",
        "grpo.max_num_steps=1e9",
        "grpo.val_batch_size=1e7",
        "grpo.stage_retries=1000",
        "grpo.refit.timeout_s=1e7",
        "grpo.stage_retry_delay_s=[1e6]",
        "data.arithmetic.num_train=1e10",
        "data.arithmetic.num_val=1e10",
        "data.max_input_seq_length=1e8",
        "generation.num_workers=5000",
        "generation.max_new_tokens=1e8",
        "generation.max_batch_size=1e8",
        "generation.seed=-1",
        "generation.vllm_cfg.max_model_len=1e8",
        "policy.train_global_batch_size=1e8",
        "policy.logprob_batch_size=1e8",
        "policy.max_total_sequence_length=1e8",
        "policy.torch_num_threads=100000",
        "policy.dynamic_batching.train_mb_tokens=1e9",
        "policy.scheduler.total_steps=1e12",
        "policy.seed=1e19",
        "cluster.policy_workers=5000",
        "cluster.ray.num_cpus=1e7",
        "checkpointing.save_period=1e9",
        "storage.retry.attempts=1e6",
    ],
)
def test_absurd_sizes_fail_before_anything_starts(override):
    key = override.split("=")[0]
    msg = _problems([override])
    assert f"  - {key}" in msg and ("less than or equal" in msg or "must be <=" in msg or "must be >=" in msg), msg


def test_rollouts_per_step_have_a_maximum():
    msg = _problems(["grpo.num_prompts_per_step=65536", "grpo.num_generations_per_prompt=32"])
    assert "= 2097152 rollouts per step exceeds 1048576" in msg, msg


def test_stop_token_lists_have_a_length_and_id_bound():
    assert "generation.stop_token_ids: must have at most 1024 items" in _problems(
        ["generation.stop_token_ids=[" + ",".join(["1"] * 2000) + "]"]
    )
    assert "generation.stop_token_ids.1: must be <= 2147483647" in _problems(["generation.stop_token_ids=[1, 10000000000000]"])


def test_integral_floats_within_bounds_stay_integers():
    cfg = load_config(TINY_CONFIG, ["data.arithmetic.num_train=1e6", "grpo.max_num_steps=2e3"])
    assert cfg.data.arithmetic.num_train == 1_000_000 and cfg.grpo.max_num_steps == 2000
    assert "data.arithmetic.num_train" in _problems(["data.arithmetic.num_train=1.5"])


# --------------------------------------------------------------------------- one error, real configs, CLI
def test_every_kind_of_problem_in_one_error():
    msg = _problems(
        [
            "grpo.max_num_steps=true",
            "policy.optimizer.kwargs.lr=.inf",
            "generation.num_workers=5000",
            "grpo.num_prompts_per_stepp=3",
            "policy.train_global_batch_size=abc",
        ]
    )
    for needle in (
        "grpo.max_num_steps: must be an integer, not a boolean",
        "policy.optimizer.kwargs.lr: must be a finite number",
        "generation.num_workers: must be <= 1024",
        "grpo.num_prompts_per_stepp: unknown key",
        "policy.train_global_batch_size: Input should be a valid integer",
    ):
        assert needle in msg, msg
    assert msg.count("\n  - ") == 5, msg


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.yaml")))
def test_shipped_configs_load(path):
    if os.path.basename(path).startswith("pipeline_"):  # a pipeline file: every stage's config is checked
        from flows.pipeline import load_pipeline, plan_stages

        plans = plan_stages(load_pipeline(path), os.path.join(os.getcwd(), "runs"), "shipped")
        assert [p["stage"].name for p in plans] == ["sft", "dpo", "grpo", "eval"]
        return
    assert load_config(path).rollout_batch_size >= 2


def test_cli_refuses_infinite_lr_and_boolean_steps(tmp_path, monkeypatch, capsys):
    import flows.algorithms.grpo
    import flows.run.runtime
    from flows.cli import main

    def tripwire(*a, **k):
        raise AssertionError("a run started despite a bad config")

    monkeypatch.setattr(flows.run.runtime, "connect_ray", tripwire)
    monkeypatch.setattr(flows.algorithms.grpo, "grpo", tripwire)
    argv = ["grpo", "--config", TINY_CONFIG, "--storage", str(tmp_path / "runs")]
    assert main(argv + ["policy.optimizer.kwargs.lr=.inf", "grpo.max_num_steps=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("nrl: error:") == 1, err
    assert "policy.optimizer.kwargs.lr: must be a finite number" in err and "grpo.max_num_steps: must be an integer" in err


@pytest.mark.parametrize("config", [TINY_CONFIG, "configs/dpo_tiny.yaml"])
def test_a_generated_data_set_larger_than_memory_allows_is_refused_naming_the_key(config, tmp_path, capsys):
    """``data.arithmetic.num_train=1e8`` (inside the old 10**8 row bound, ~10 GB in preflight) is a
    config error naming the key before anything runs; so is a few-shot set that would not fit
    (issue 27, item 5)."""
    import time

    from flows.cli import main

    kind = "dpo" if "dpo" in config else "grpo"
    t = time.monotonic()
    assert main([kind, "--config", config, "--storage", str(tmp_path / "runs"), "data.arithmetic.num_train=1e8"]) == 2
    err = capsys.readouterr().err
    assert "data.arithmetic.num_train=100000000 would take about" in err and "GiB" in err, err
    assert time.monotonic() - t < 30
    msg = _problems(["data.arithmetic.num_val=1e6", "data.arithmetic.few_shot=1024"])
    assert "data.arithmetic.num_val=1000000 would take about" in msg, msg
    assert load_config(TINY_CONFIG, ["data.arithmetic.num_train=1e6"]).data.arithmetic.num_train == 10**6
