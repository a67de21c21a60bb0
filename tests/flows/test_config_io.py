"""Config YAML is read by one bounded loader: repeated keys, alias bombs, oversized, empty and corrupt
files each give one ``ConfigError`` naming the file (issue 14, items 3, 4 and 6).

Nothing here starts Ray or Prefect: the CLI tests swap the flow for a tripwire.
"""

from __future__ import annotations

import re

import pytest
import yaml

from flows.config import ConfigError, load_config, load_config_dict, saved_config_hash
from tests.flows.conftest import TINY_CONFIG


def _tiny_text() -> str:
    with open(TINY_CONFIG, encoding="utf-8") as fh:
        return fh.read()


def _write(tmp_path, text: str, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def _bomb(levels: int = 6) -> str:
    """Anchors nesting 10 aliases per level: ``10**levels`` leaves in a few hundred bytes."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "{" + ", ".join(lines) + "}"


# --------------------------------------------------------------------------- repeated keys
def test_second_section_is_an_error_naming_file_line_and_key(tmp_path):
    text = _tiny_text()
    path = _write(tmp_path, text + "grpo:\n  max_num_steps: 5\n")  # used to reset num_prompts_per_step to 8
    line = text.count("\n") + 1
    first = text.splitlines().index("grpo:") + 1
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert path in msg and f"line {line}: duplicate key grpo (first at line {first})" in msg, msg


def test_repeated_nested_key_names_its_dotted_path(tmp_path):
    text = _tiny_text().replace("kwargs: {lr: 1.0e-3,", "kwargs: {lr: 1.0e-3, lr: 5.0,")
    assert "lr: 5.0" in text
    with pytest.raises(ConfigError, match=r"line \d+: duplicate key policy\.optimizer\.kwargs\.lr"):
        load_config(_write(tmp_path, text))
    with pytest.raises(ConfigError, match="duplicate key grpo.seed"):  # block style, deeper in a section
        load_config(_write(tmp_path, _tiny_text().replace("  seed: 42\n", "  seed: 42\n  seed: 43\n")))


def test_repeated_key_in_an_override_value_names_the_key():
    with pytest.raises(ConfigError, match="override 'data.arithmetic', line 1: duplicate key num_train"):
        load_config(TINY_CONFIG, ["data.arithmetic={num_train: 64, num_train: 128}"])


def test_anchors_and_merge_keys_within_bounds_still_work(tmp_path):
    text = "x_defaults: &gen {max_new_tokens: 8, temperature: 0.5}\n" + _tiny_text()
    text = text.replace("generation:\n", "generation:\n  <<: *gen\n").replace("  temperature: 1.0\n", "")
    text = text.replace("  max_new_tokens: 8\n", "")
    path = _write(tmp_path, text)
    data = load_config_dict(path)
    assert data == yaml.safe_load(text) and data["generation"]["temperature"] == 0.5
    with pytest.raises(ConfigError, match="x_defaults: unknown key"):  # the loader let it through; the schema did not
        load_config(path)
    del data["x_defaults"]
    assert load_config(data).gen.max_new_tokens == 8


# --------------------------------------------------------------------------- bounds of the input
def test_alias_bomb_is_refused_naming_the_file(tmp_path):
    # a free-form dict takes any value: before, this loaded, and hashing or saving it walked 10**6 nodes
    bomb = "{defs: " + _bomb() + ", x: *a5}"
    path = _write(tmp_path, _tiny_text().replace("generation:\n", "generation:\n  vllm_cfg: {llm_kwargs: " + bomb + "}\n"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert path in str(info.value) and "expands to more than 100000 YAML nodes" in str(info.value)
    with pytest.raises(ConfigError, match="override 'generation.vllm_cfg.llm_kwargs' expands to more than"):
        load_config(TINY_CONFIG, ["generation.vllm_cfg.llm_kwargs=" + _bomb()])


def test_recursive_alias_and_deep_nesting_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="recursive YAML alias at grpo.0"):
        load_config(_write(tmp_path, "grpo: &a [*a]\n"))
    with pytest.raises(ConfigError, match="nests more than 64 levels deep"):
        load_config(_write(tmp_path, "grpo: " + "[" * 200 + "]" * 200 + "\n"))
    with pytest.raises(ConfigError, match="cannot be read as YAML"):  # libyaml's own cap (1000) or recursion
        load_config(_write(tmp_path, "grpo: " + "[" * 5000 + "]" * 5000 + "\n"))


def test_oversized_file_is_refused_naming_the_file(tmp_path):
    path = _write(tmp_path, _tiny_text() + "#" + "x" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"config file '{path}' is larger than the 1048576 bytes")):
        load_config(path)


def test_huge_integer_literal_is_a_config_error(tmp_path):
    path = _write(tmp_path, _tiny_text().replace("  seed: 42", "  seed: " + "1" * 5000))
    with pytest.raises(ConfigError, match=re.escape(f"config file '{path}' cannot be read as YAML")):
        load_config(path)


# --------------------------------------------------------------------------- empty and corrupt files
def test_empty_config_file_is_one_clear_error(tmp_path):
    for text in ("", "# only a comment\n", "---\n"):
        path = _write(tmp_path, text)
        with pytest.raises(ConfigError, match=re.escape(f"config file '{path}' is empty")):
            load_config(path)


def test_saved_config_text_errors_name_the_saved_file():
    from flows.config import load_config_text

    uri = "s3://bucket/runs/grpo-x/config.yaml"
    for text, needle in (
        ("", "is empty"),
        ("grpo: [1, 2\n", "cannot be read as YAML"),
        ("- 1\n", "mapping at top level"),
        ("grpo: {}\ngrpo: {}\n", "line 2: duplicate key grpo"),
    ):
        with pytest.raises(ConfigError, match=f"config file '{uri}'.*{needle}"):
            load_config_text(text, uri)
        with pytest.raises(ConfigError, match=f"config file '{uri}'"):
            saved_config_hash(text, uri)
    data = load_config_text(f"config_hash: abc\n{_tiny_text()}", uri)
    assert "config_hash" not in data and load_config(data).grpo.num_prompts_per_step == 4
    with pytest.raises(ConfigError, match=f"invalid config '{uri}'"):  # validation errors name it too
        load_config({**data, "grpo": {"bogus": 1}}, name=uri)


def _tripwire(monkeypatch):
    import flows.algorithms.grpo
    import flows.run.runtime

    def tripwire(*a, **k):
        raise AssertionError("a run started despite a bad config")

    monkeypatch.setattr(flows.run.runtime, "connect_ray", tripwire)
    monkeypatch.setattr(flows.algorithms.grpo, "grpo", tripwire)


def test_cli_grpo_reports_a_bad_config_file_in_one_line(tmp_path, monkeypatch, capsys):
    from flows.cli import main

    _tripwire(monkeypatch)
    for text, needle in (
        (_tiny_text() + "grpo:\n  max_num_steps: 5\n", "duplicate key grpo"),
        ("grpo: [1, 2\n", "cannot be read as YAML"),
        ("", "is empty"),
    ):
        path = _write(tmp_path, text)
        assert main(["grpo", "--config", path, "--storage", str(tmp_path / "runs")]) == 2
        err = capsys.readouterr().err
        assert err.count("nrl: error:") == 1 and path in err and needle in err, err


@pytest.mark.parametrize("text, needle", [("", "is empty"), ("grpo: [1, 2\n", "cannot be read as YAML")])
def test_cli_resume_reports_an_empty_or_corrupt_saved_config(tmp_path, monkeypatch, capsys, text, needle):
    from flows.cli import main
    from nrl_tasks.run_layout import RunLayout

    _tripwire(monkeypatch)
    root = str(tmp_path / "runs")
    layout = RunLayout(root, "grpo-bad")
    (tmp_path / "runs" / "grpo-bad").mkdir(parents=True)
    with open(layout.config_uri, "w", encoding="utf-8") as fh:
        fh.write(text)
    assert main(["resume", "grpo-bad", "--storage", root]) == 2
    err = capsys.readouterr().err
    assert err.count("nrl: error:") == 1 and layout.config_uri in err and needle in err, err
