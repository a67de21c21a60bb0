"""The fault suites' plug-in: point parsing, and inert unless its variables name a point."""

from __future__ import annotations

import pytest


def test_fault_hook_parsing_and_noop(monkeypatch):
    from tests.faults.injection import ENV_VAR, fault_point, parse_fault_points

    assert parse_fault_points("train@3:after,checkpoint@2:before") == {("train", 3, "after"), ("checkpoint", 2, "before")}
    with pytest.raises(ValueError, match="stage@step"):
        parse_fault_points("train3")
    monkeypatch.setenv(ENV_VAR, "train@3:after")
    fault_point("train", 3, "before")  # not the named point: nothing happens
    fault_point("train", 2, "after")


def test_installed_through_nrl_plugins():
    from flows.run.plugins import PluginSettings, load_observers
    from tests.faults.injection import FaultInjector

    obs = load_observers(PluginSettings(plugins="tests.faults.injection"))
    assert len(obs.observers) == 1 and isinstance(obs.observers[0], FaultInjector)
    with pytest.raises(ValueError, match="NRL_PLUGINS: cannot load tests.faults.nope:observer"):
        load_observers(PluginSettings(plugins="tests.faults.nope"))
