"""The one registry of algorithms: a run's kind -> its recipe (:class:`flows.run.recipe.Recipe`).

Adding an algorithm is one module implementing the recipe plus one line in :data:`RECIPES`. A
recipe that lives outside this package (a plug-in, a test) is named by the config's ``algorithm``
key as ``module:attribute`` and loaded from there, like ``env.environment``.

A run's kind is read from its config, once (:func:`nrl_tasks.config.master.config_kind`): the
``algorithm`` key when set, else the algorithm whose section the config has (``dpo:`` -> DPO,
``sft:`` -> SFT, ``rm:`` -> reward-model training), else GRPO, whose section every config has (its defaults). The run's
``status.json`` records the kind too (``nrl runs``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from flows.algorithms.distill import DISTILL
from flows.algorithms.dpo import DPO
from flows.algorithms.grpo import GRPO
from flows.algorithms.ppo import PPO
from flows.algorithms.rm import RM
from flows.algorithms.sft import SFT
from flows.config import ConfigError, MasterConfig
from flows.run.recipe import Recipe
from nrl_tasks.config.master import config_kind

__all__ = ["RECIPES", "recipe_for", "recipe_of"]

#: every registered algorithm, by kind
RECIPES: dict[str, Recipe] = {r.kind: r for r in (GRPO, DPO, SFT, RM, DISTILL, PPO)}


def recipe_for(kind: str) -> Recipe:
    """The recipe of ``kind``: a registered kind, or ``module:attribute`` of a recipe object
    (``ConfigError`` naming the key when neither)."""
    if kind in RECIPES:
        return RECIPES[kind]
    if ":" not in kind:
        raise ConfigError(f"algorithm {kind!r} is not one of {sorted(RECIPES)} (or module:attribute of a recipe)")
    module, _, attr = kind.partition(":")
    try:
        recipe = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"algorithm {kind!r}: cannot load it ({type(exc).__name__}: {exc})") from None
    if not isinstance(recipe, Recipe):
        raise ConfigError(f"algorithm {kind!r} is a {type(recipe).__name__}, not a recipe (flows.run.recipe.Recipe)")
    if recipe.kind != kind:
        raise ConfigError(f"algorithm {kind!r}: the recipe's kind is {recipe.kind!r}; it must be the name it is loaded by")
    return recipe


def recipe_of(config: MasterConfig | Mapping[str, Any]) -> Recipe:
    """The recipe of a config or its data (its kind: see the module docstring)."""
    return recipe_for(config_kind(dict(config) if isinstance(config, Mapping) else config))
