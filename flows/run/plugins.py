"""Plug-ins: stage observers named in the environment, installed on a run's context.

``NRL_PLUGINS="package.module[:factory],..."`` names modules whose ``factory`` (default
``observer``) returns a :class:`~nrl_tasks.stages.context.StageObserver`, or ``None`` when it has
nothing to do in this process. The flow installs them on the run's context, so they see every
stage start, compute and commit and every call into an actor group. Production ships none; the
fault suites install their fault injector this way (``tests/faults/injection.py``), which reaches
flow processes started by the CLI or by a Prefect worker through their environment.

>>> PluginSettings(plugins="a.b, c.d:make").specs()
[('a.b', 'observer'), ('c.d', 'make')]
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from nrl_tasks.settings import nrl_settings
from nrl_tasks.stages.context import Observers, StageObserver
from nrl_tasks.utils.import_path import import_attribute

__all__ = ["PluginSettings", "load_observers"]


class PluginSettings(BaseModel):
    """The plug-in loader's knob; not given: ``NRL_PLUGINS`` (:class:`nrl_tasks.settings.NrlSettings`)."""

    #: comma-separated ``module[:factory]`` items
    plugins: str = Field(default_factory=lambda: nrl_settings().plugins)

    def specs(self) -> list[tuple[str, str]]:
        out = []
        for item in filter(None, (s.strip() for s in self.plugins.split(","))):
            module, _, factory = item.partition(":")
            out.append((module, factory or "observer"))
        return out


def load_observers(settings: PluginSettings | None = None, *, isolate: bool = False) -> Observers:
    """The observers of the configured plug-ins; ``ValueError`` naming a plug-in that cannot load
    (whatever its import raises: :func:`~nrl_tasks.utils.import_path.import_attribute`;
    ``isolate``, preflight: a module not imported yet is imported in a child process first, so an
    exit or a hang at import is one too)."""
    found: list[StageObserver] = []
    for module, factory in (settings or PluginSettings()).specs():
        make = import_attribute(module, factory, f"NRL_PLUGINS: cannot load {module}:{factory}", isolate=isolate)
        obs = make()
        if obs is not None:
            found.append(obs)
    return Observers(found)
