"""A user's plug-in module that exits, hangs or raises anything at import (``env.reward_fn``,
``env.environment``) is a config error of ``nrl grpo`` (exit 2, naming the key and the module),
found by preflight before Ray, Prefect or the run's directory exist: the module is imported
first in a child process under ``NRL_PLUGIN_IMPORT_TIMEOUT_S``
(:mod:`nrl_tasks.utils.import_path`)."""

from __future__ import annotations

import pytest

from tests.flows.conftest import TINY_CONFIG

#: module body -> what the error says about it
PLUGINS = {
    "exits": ("import sys\nsys.exit(0)\n", "raised SystemExit"),
    "hard_exits": ("import os\nos._exit(0)\n", "exited at import with status 0"),
    "syntax": ("def f(:\n", "raised SyntaxError"),
    "runtime": ("raise RuntimeError('no GPU here')\n", "raised RuntimeError: no GPU here"),
    "interrupts": ("raise KeyboardInterrupt\n", "raised KeyboardInterrupt"),
    "sleeps": ("import time\ntime.sleep(600)\n", "did not finish within 1 s (NRL_PLUGIN_IMPORT_TIMEOUT_S)"),
}


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A folder on ``sys.path`` holding one module per :data:`PLUGINS` entry (``nrl_plug_<name>``),
    each also defining ``f`` (a reward function) and ``Env`` (an environment class)."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    for name, (body, _) in PLUGINS.items():
        tail = "\ndef f(prompts, responses, answers):\n    return [0.0] * len(prompts)\n" \
               "\nclass Env:\n    def step(self, message_logs, metadata):\n        return None\n"
        (folder / f"nrl_plug_{name}.py").write_text(body + tail)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("NRL_PLUGIN_IMPORT_TIMEOUT_S", "1")
    return folder


@pytest.mark.parametrize("key, attr", [("env.reward_fn", "f"), ("env.environment", "Env")])
@pytest.mark.parametrize("name", sorted(PLUGINS))
def test_a_plugin_that_exits_hangs_or_raises_at_import_is_a_config_error(name, key, attr, plugin_dir, tmp_path, capsys,
                                                                         monkeypatch):
    from flows.cli import main

    if name != "sleeps":  # 1 s is for the hang; a child that starts slowly on a busy machine is not one
        monkeypatch.setenv("NRL_PLUGIN_IMPORT_TIMEOUT_S", "120")
    root = tmp_path / "runs"
    rc = main(["grpo", "--config", TINY_CONFIG, "--storage", str(root), "--run-id", "r1", f"{key}=nrl_plug_{name}:{attr}"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("nrl: error:") == 1 and key in err and f"nrl_plug_{name}" in err, err
    assert PLUGINS[name][1] in err, err  # for the hang: "did not finish within 1 s", so it was cut
    assert not (root / "r1").exists()  # nothing started, nothing written


def test_a_good_user_plugin_still_loads(tmp_path, monkeypatch):
    """The child's import passes, then the module is imported here (once)."""
    import sys

    from nrl_tasks.environments.rewards import load_reward_fn

    (tmp_path / "nrl_plug_good.py").write_text("def f(p, r, a):\n    return [1.0] * len(p)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_fn("nrl_plug_good:f", isolate=True)
    assert fn(["a"], ["b"], ["c"]) == [1.0] and "nrl_plug_good" in sys.modules
    sys.modules.pop("nrl_plug_good")


def test_a_missing_user_module_keeps_its_import_error_words(tmp_path):
    from nrl_tasks.utils.import_path import check_import_in_child

    with pytest.raises(ValueError, match=r"^x: cannot import module 'nrl_no_such_plugin': No module named"):
        check_import_in_child("nrl_no_such_plugin", "x", timeout_s=30)


@pytest.mark.parametrize("name", ["exits", "hard_exits", "interrupts"])
def test_stage_observer_plugins_that_exit_or_raise_at_import_are_value_errors(name, plugin_dir, monkeypatch):
    """``NRL_PLUGINS``: every ``BaseException`` of the import is a ``ValueError`` naming the
    plug-in, in this process too; ``os._exit`` (which would end this process) only in preflight's child."""
    from flows.run.plugins import PluginSettings, load_observers

    settings = PluginSettings(plugins=f"nrl_plug_{name}")
    with pytest.raises(ValueError, match=rf"^NRL_PLUGINS: cannot load nrl_plug_{name}:observer: module .* at import"
                       if name == "hard_exits" else rf"^NRL_PLUGINS: cannot load nrl_plug_{name}:observer: .* raised"):
        load_observers(settings, isolate=True)
    if name != "hard_exits":
        with pytest.raises(ValueError, match=r"raised (SystemExit|KeyboardInterrupt)"):
            load_observers(settings)


def test_an_environment_whose_constructor_exits_is_a_config_error(tmp_path, monkeypatch, capsys):
    from flows.cli import main

    (tmp_path / "nrl_plug_env_exits.py").write_text(
        "import sys\n\nclass Env:\n    def __init__(self):\n        sys.exit(1)\n\n    def step(self, m, d):\n        return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["grpo", "--config", TINY_CONFIG, "--storage", str(tmp_path / "runs"), "env.environment=nrl_plug_env_exits:Env"])
    err = capsys.readouterr().err
    assert rc == 2 and "env.environment 'nrl_plug_env_exits:Env'" in err and "building it raised SystemExit: 1" in err, err


@pytest.mark.parametrize("name", ["hard_exits", "interrupts"])
def test_nrl_grpo_process_exits_2_for_a_plugin_that_exits_or_interrupts_at_import(name, plugin_dir, tmp_path):
    """The command as a user runs it: the process's own exit status is the config error's (not 0
    after printing nothing, not 130 "interrupted")."""
    import os
    import subprocess
    import sys

    from tests.flows.conftest import REPO

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_dir), REPO]), "NRL_PLUGIN_IMPORT_TIMEOUT_S": "60"}
    args = ["grpo", "--config", TINY_CONFIG, "--storage", str(tmp_path / "runs"), f"env.reward_fn=nrl_plug_{name}:f"]
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"nrl: error: env.reward_fn: reward_fn 'nrl_plug_{name}:f'"), proc.stderr
