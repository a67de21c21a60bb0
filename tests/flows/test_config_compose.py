"""NeMo-RL's config format (issue 42, item 1): ``defaults:`` chains and ``${...}`` interpolation with
NeMo-RL's resolvers, resolved after the overrides; each failure one error naming file and key,
exit 2 from ``nrl check`` and nothing created. Nothing here starts Ray or Prefect.
"""

from __future__ import annotations

import os

import pytest

from flows.cli import main
from flows.config import ConfigError, config_hash, load_config, read_config_data
from tests.flows.conftest import TINY_CONFIG


def _write(path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return str(path)


def _tiny_parent(tmp_path) -> str:
    """A copy of the tiny GRPO config one folder down, so children name it by a relative path."""
    with open(TINY_CONFIG, encoding="utf-8") as fh:
        return _write(tmp_path / "base" / "grpo_tiny.yaml", fh.read())


def test_a_defaults_chain_merges_parents_in_order_then_the_child(tmp_path):
    _tiny_parent(tmp_path)
    # the parent names its own parent relative to itself, the child relative to the child
    _write(tmp_path / "base" / "mid.yaml", "defaults: grpo_tiny.yaml\ngrpo: {seed: 7, max_num_steps: 5}\n")
    _write(tmp_path / "base" / "lr.yaml", "policy: {optimizer: {kwargs: {lr: 0.002}}}\n")
    child = _write(tmp_path / "recipes" / "llm" / "child.yaml",
                   "defaults: [../../base/mid.yaml, ../../base/lr.yaml]\ngrpo: {max_num_steps: 9}\n")
    cfg = load_config(child)
    assert (cfg.grpo.seed, cfg.grpo.max_num_steps) == (7, 9)  # grandparent < parent < child
    assert cfg.grpo.num_prompts_per_step == 4  # from the grandparent
    assert cfg.policy.optimizer.kwargs.lr == 0.002 and cfg.policy.optimizer.kwargs.weight_decay == 0.0
    flat = load_config(TINY_CONFIG, ["grpo.seed=7", "grpo.max_num_steps=9", "policy.optimizer.kwargs.lr=0.002"])
    assert config_hash(cfg) == config_hash(flat)


def test_override_marker_replaces_the_parents_section_whole(tmp_path):
    _tiny_parent(tmp_path)
    child = _write(tmp_path / "c.yaml", "defaults: base/grpo_tiny.yaml\n"
                   "data: {_override_: true, dataset: arithmetic, arithmetic: {num_train: 32, num_val: 4}}\n")
    cfg = load_config(child)
    assert cfg.data.arithmetic.num_train == 32
    assert read_config_data(child)["data"] == {"dataset": "arithmetic", "arithmetic": {"num_train": 32, "num_val": 4}}
    merged = read_config_data(_write(tmp_path / "m.yaml", "defaults: base/grpo_tiny.yaml\n"
                                     "data: {arithmetic: {num_train: 32, num_val: 4}}\n"))
    assert merged["data"]["arithmetic"] == {"num_train": 32, "num_val": 4, "max_operand": 9, "ops": ["+"]}


def test_interpolations_resolve_after_the_overrides_with_nemo_rls_resolvers(tmp_path):
    _tiny_parent(tmp_path)
    child = _write(tmp_path / "c.yaml", "defaults: base/grpo_tiny.yaml\n"
                   "policy:\n  train_global_batch_size: ${mul:${grpo.num_prompts_per_step}, ${grpo.num_generations_per_prompt}}\n"
                   "  train_micro_batch_size: ${max:${div:${policy.train_global_batch_size}, 4}, 2}\n"
                   "generation: {max_new_tokens: '${add:4, 4}'}\n")
    cfg = load_config(child)
    assert (cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size, cfg.generation.max_new_tokens) == (16, 4, 8)
    cfg = load_config(child, ["grpo.num_prompts_per_step=8"])  # the override reaches both values that refer to it
    assert (cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size) == (32, 8)
    assert "${" in str(read_config_data(child)["policy"])  # the kind is read before anything is resolved
    assert config_hash(cfg) == config_hash(load_config(TINY_CONFIG, [
        "grpo.num_prompts_per_step=8", "policy.train_global_batch_size=32", "policy.train_micro_batch_size=8"]))


@pytest.mark.parametrize(
    "files, needles",
    [
        ({"c.yaml": "defaults: b.yaml\ngrpo: {seed: 1}\n", "b.yaml": "defaults: c.yaml\n"}, ["cycle", "c.yaml", "b.yaml"]),
        ({"c.yaml": "defaults: [base/grpo_tiny.yaml, gone.yaml]\n"}, ["c.yaml", "'gone.yaml' does not exist"]),
        ({"c.yaml": "defaults: base/grpo_tiny.yaml\npolicy: {max_total_sequence_length: '${policy.max_seq}'}\n"},
         ["c.yaml", "policy.max_total_sequence_length", "policy.max_seq"]),
        ({"c.yaml": "defaults: base/grpo_tiny.yaml\ngrpo: {max_num_steps: '${div:4, 0}'}\n"},
         ["c.yaml", "grpo.max_num_steps", "ZeroDivisionError"]),
        ({"c.yaml": "defaults: base/grpo_tiny.yaml\npolicy: {model_name: '???'}\n"}, ["c.yaml", "policy.model_name", "???"]),
        ({"c.yaml": "defaults: {a: 1}\n"}, ["c.yaml", "defaults:", "file path"]),
    ],
    ids=["cycle", "missing-parent", "missing-key", "resolver-error", "mandatory-unset", "bad-defaults"],
)
def test_each_composition_failure_is_one_error_naming_file_and_key_exit_2_nothing_created(
        files, needles, tmp_path, monkeypatch, capsys):
    _tiny_parent(tmp_path)
    for name, text in files.items():
        _write(tmp_path / name, text)
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ConfigError) as err:
        load_config(str(tmp_path / "c.yaml"))
    for needle in needles:
        assert needle in str(err.value)
    assert main(["check", str(tmp_path / "c.yaml")]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("nrl: error: ") and needles[0] in out.err and "Traceback" not in out.err
    assert main(["grpo", "--config", str(tmp_path / "c.yaml")]) == 2
    assert sorted(os.listdir(tmp_path)) == before  # no runs/ folder, no run


def test_nrl_check_prints_the_kind_and_the_hash_a_run_would_record(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["check", TINY_CONFIG, "grpo.max_num_steps=4", "--resolved"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(TINY_CONFIG, ["grpo.max_num_steps=4"])
    assert f"a valid GRPO config, hash {config_hash(cfg)}" in out
    assert "max_num_steps: 4" in out and os.listdir(tmp_path) == []
    dpo_config = os.path.join(os.path.dirname(TINY_CONFIG), "dpo_tiny.yaml")
    assert main(["check", dpo_config, "grpo.max_num_steps=4"]) == 2  # an override the run never reads
    assert "does not apply to a DPO run" in capsys.readouterr().err
