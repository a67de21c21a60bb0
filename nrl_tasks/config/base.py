"""The one base class of every run-config section (:mod:`nrl_tasks.config`, and the sections of
``nrl_tasks.models`` / ``nrl_tasks.algorithms`` that the run config embeds).

- ``extra="forbid"``: a typo is an error naming the key, not a silently ignored setting;
- ``validate_assignment=True``: ``cfg.grpo.seed = "x"`` is refused like the same value in YAML;
- ``allow_inf_nan=False``: numbers are finite. The config loader reports ``inf`` / ``nan`` first
  (:func:`nrl_tasks.config.bounds.value_errors`, with the key), so this only shows when a section
  is built directly (``PolicyConfig(max_grad_norm=float("inf"))``).

Not frozen: the flows build changed copies with ``model_copy(update=...)``, never in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["Section", "flatten"]


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every leaf of nested mappings by its dotted key (an empty mapping is a leaf).

    >>> flatten({"a": {"b": 1, "c": {}}, "d": [1]})
    {'a.b': 1, 'a.c': {}, 'd': [1]}
    """
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class Section(BaseModel):
    """A section of the run config (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
