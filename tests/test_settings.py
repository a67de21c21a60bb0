"""The ``NRL_*`` settings classes: re-read on change, validated with the variable named, the
views kept for their old users (``LeaseSettings``, ``PluginSettings``), every variable documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from nrl_tasks.settings import NrlSettings, WorkerEnv, nrl_settings
from storage.settings import StorageSettings, storage_settings

REPO = Path(__file__).resolve().parents[1]


def test_nrl_settings_follow_the_environment(monkeypatch):
    monkeypatch.delenv("NRL_KEEP_ACTORS", raising=False)
    monkeypatch.delenv("NRL_PROBE_TIMEOUT_S", raising=False)
    assert nrl_settings().keep_actors is False and nrl_settings().probe_timeout_s == 30.0
    assert nrl_settings() is nrl_settings()  # cached while the environment is unchanged
    monkeypatch.setenv("NRL_KEEP_ACTORS", "1")
    monkeypatch.setenv("NRL_PROBE_TIMEOUT_S", "3")
    assert nrl_settings().keep_actors is True and nrl_settings().probe_timeout_s == 3.0
    monkeypatch.setenv("NRL_KEEP_ACTORS", "")  # empty: unset
    assert nrl_settings().keep_actors is False
    monkeypatch.setenv("NRL_KEEP_ACTORS", "0")
    assert nrl_settings().keep_actors is False
    monkeypatch.setenv("nrl_keep_actors", "1")  # names are exact
    assert nrl_settings().keep_actors is False


@pytest.mark.parametrize(
    "name, value",
    [
        ("NRL_KEEP_ACTORS", "maybe"),
        ("NRL_PROBE_TIMEOUT_S", "0"),
        ("NRL_REFIT_NUM_BUFFERS", "zero"),
        ("NRL_REFIT_BUFFER_MEMORY_RATIO", "1.5"),
        ("NRL_LEASE_TTL_S", "-1"),
    ],
)
def test_a_bad_value_names_its_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        nrl_settings()


def test_storage_settings(monkeypatch):
    for name in ("NRL_STORAGE_RETRY_ATTEMPTS", "NRL_STORAGE_RETRY_INITIAL_S", "NRL_STORAGE_RETRY_MAX_S"):
        monkeypatch.delenv(name, raising=False)
    assert storage_settings().retry_overrides() == {}
    monkeypatch.setenv("NRL_STORAGE_RETRY_MAX_S", "2")
    assert storage_settings().retry_overrides() == {"max_delay_s": 2.0}
    monkeypatch.setenv("NRL_STORAGE_RETRY_ATTEMPTS", "0")
    with pytest.raises(ValueError, match="NRL_STORAGE_RETRY_ATTEMPTS"):
        storage_settings()


def test_views_keep_their_names(monkeypatch):
    from flows.run.plugins import PluginSettings
    from flows.run.lease import LeaseSettings

    monkeypatch.setenv("NRL_LEASE_TTL_S", "5")
    monkeypatch.setenv("NRL_PLUGINS", "a.b")
    assert LeaseSettings().ttl_s == 5.0 and LeaseSettings().heartbeat_s == 10.0
    assert LeaseSettings(ttl_s=30.0, heartbeat_s=0.2).ttl_s == 30.0
    with pytest.raises(ValueError):
        LeaseSettings(heartbeat_s=0)
    assert PluginSettings().plugins == "a.b" and PluginSettings(plugins="c.d").specs() == [("c.d", "observer")]


def test_worker_env(monkeypatch):
    for name in ("NRL_WORKER_RANK", "NRL_WORKER_WORLD_SIZE", "NRL_WORKER_GROUP"):
        monkeypatch.delenv(name, raising=False)
    assert (WorkerEnv().rank, WorkerEnv().world_size, WorkerEnv().group) == (0, None, None)
    monkeypatch.setenv("NRL_WORKER_RANK", "3")
    monkeypatch.setenv("NRL_WORKER_WORLD_SIZE", "4")
    assert (WorkerEnv().rank, WorkerEnv().world_size) == (3, 4)


def test_every_variable_is_documented():
    table = (REPO / "docs" / "settings.md").read_text(encoding="utf-8")
    for cls in (NrlSettings, StorageSettings, WorkerEnv):
        for field in cls.model_fields.values():
            assert f"`{field.validation_alias}`" in table, field.validation_alias


@pytest.mark.parametrize(
    ("name", "value"), [("NRL_LEASE_TTL_S", "abc"), ("NRL_PROBE_TIMEOUT_S", "-1"), ("NRL_STORAGE_RETRY_ATTEMPTS", "0")]
)
def test_nrl_refuses_a_bad_setting_first_naming_the_variable(tmp_path, name, value):
    """``NRL_LEASE_TTL_S=abc`` (or a storage knob out of range) is a usage error, exit 2, naming the
    variable and its value, before any run directory, Prefect or Ray exists (was: a failure after
    Prefect started, not naming the variable) (issue 27, item 6c)."""
    import os
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, name: value, "PYTHONPATH": str(repo)}
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "grpo", "--config", "configs/grpo_tiny.yaml", "--storage", str(tmp_path / "runs")],
        cwd=repo, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"nrl: error: environment variable {name}={value!r}: "), proc.stderr
    assert not (tmp_path / "runs").exists() and time.monotonic() - t < 60
