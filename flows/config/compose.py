"""NeMo-RL's config file format: ``defaults:`` inheritance and OmegaConf ``${...}`` interpolation.

A NeMo-RL config names its parents in ``defaults:`` (a path or a list of paths, relative to the
file that names them); the parents are merged in order, then the file itself on top. Mappings
merge key by key; any other value (a list, a number, ``null``) replaces the parent's. A mapping
marked ``_override_: true`` replaces the parent's mapping whole instead of merging into it.

Values such as ``${policy.max_total_sequence_length}`` or
``${mul:${policy.max_total_sequence_length}, ${policy.train_micro_batch_size}}`` are resolved by
OmegaConf itself, with the resolvers NeMo-RL registers (``add``, ``mul``, ``div``, ``max``), and only
*after* the ``key=value`` overrides are applied, so an override of a referenced key reaches every
value that refers to it (as in NeMo-RL). The resolved config is what is validated, saved and hashed.

Each file is read by :func:`flows.config.io.load_yaml_file` (bounded, no repeated keys), not by
``OmegaConf.load``. Every failure is one :class:`ConfigError` naming the file and, for an
interpolation, the key: a cycle in ``defaults:``, a missing parent, a reference to a missing key,
a mandatory ``???`` value left unset, a resolver's error.

Deviation from NeMo-RL: ``_override_`` is honoured at any depth (NeMo-RL honours it on top-level
sections only, and a deeper marker would reach its config as a key).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flows.config.io import load_yaml_file
from nrl_tasks.config.errors import ConfigError

__all__ = ["MAX_DEFAULTS_DEPTH", "OVERRIDE_MARKER", "compose_file", "merge", "resolve_interpolations"]

OVERRIDE_MARKER = "_override_"
"""A mapping holding ``_override_: true`` replaces its parent's mapping instead of merging into it."""
MAX_DEFAULTS_DEPTH = 32
"""Longest chain of ``defaults:`` parents (NeMo-RL's recipes chain two or three)."""

_RESOLVERS = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "max": lambda a, b: max(a, b),
}


def _register_resolvers() -> None:
    for name, fn in _RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


_register_resolvers()


def merge(parent: Mapping[str, Any], child: Mapping[str, Any]) -> dict[str, Any]:
    """``child`` merged onto ``parent`` (new dicts; neither is changed).

    >>> merge({"a": {"x": 1, "y": 2}, "l": [1, 2]}, {"a": {"y": 3}, "l": [9]})
    {'a': {'x': 1, 'y': 3}, 'l': [9]}
    >>> merge({"a": {"x": 1, "y": 2}}, {"a": {"_override_": True, "y": 3}})
    {'a': {'y': 3}}
    """
    out = {k: v for k, v in parent.items()}
    for key, value in child.items():
        if isinstance(value, Mapping):
            replace = value.get(OVERRIDE_MARKER) is True
            value = {k: v for k, v in value.items() if k != OVERRIDE_MARKER}
            base = out.get(key)
            out[key] = merge({} if replace or not isinstance(base, Mapping) else base, value)
        else:
            out[key] = value
    return out


def compose_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The config in ``path`` with its ``defaults:`` parents merged beneath it (interpolations left as
    written). ``ConfigError`` naming the file for a cycle, a missing parent or a bad ``defaults:``."""
    return _compose(os.path.abspath(os.fspath(path)), ())


def _compose(path: str, chain: tuple[str, ...]) -> dict[str, Any]:
    if path in chain:
        loop = " -> ".join(repr(p) for p in chain[chain.index(path):] + (path,))
        raise ConfigError(f"config file {chain[-1]!r}: `defaults:` makes a cycle: {loop}")
    if len(chain) >= MAX_DEFAULTS_DEPTH:
        raise ConfigError(f"config file {path!r}: `defaults:` chains more than {MAX_DEFAULTS_DEPTH} files deep")
    data = load_yaml_file(path)
    if "defaults" not in data:
        return data
    parents = data.pop("defaults")
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) and p.strip() for p in parents):
        raise ConfigError(
            f"config file {path!r}: `defaults:` must be a file path or a list of file paths, got {parents!r}"
        )
    here = os.path.dirname(path)
    base: dict[str, Any] = {}
    for parent in parents:
        parent_path = os.path.normpath(os.path.join(here, os.path.expanduser(parent)))
        if not os.path.isfile(parent_path):
            raise ConfigError(
                f"config file {path!r}: its `defaults:` parent {parent!r} does not exist (looked for {parent_path!r})"
            )
        base = merge(base, _compose(parent_path, chain + (path,)))
    return merge(base, data)


def _any_string(value: Any, test: Callable[[str], bool]) -> bool:
    """Whether ``test`` holds for a string anywhere in ``value`` (mappings and lists walked)."""
    if isinstance(value, str):
        return test(value)
    if isinstance(value, Mapping):
        return any(_any_string(v, test) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_any_string(v, test) for v in value)
    return False


def resolve_interpolations(data: dict[str, Any], source: str) -> dict[str, Any]:
    """``data`` with every ``${...}`` resolved by OmegaConf (``data`` itself when it has none).

    ``ConfigError`` naming ``source`` and the key for a reference to a missing key, a ``???``
    left unset, a resolver's error or a reference cycle.
    """
    if not _any_string(data, lambda v: "${" in v or v == "???"):
        return data
    try:
        conf = OmegaConf.create(data)
        resolved = OmegaConf.to_container(conf, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "<config>"
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if type(exc).__name__ == "MissingMandatoryValue":
            message = "mandatory value `???` was not set (give it in the file or as an override)"
        raise ConfigError(f"config {source}: cannot resolve {key}: {message}") from None
    except (ValueError, TypeError, ArithmeticError) as exc:  # a resolver's own error, e.g. ${div:1,0}
        raise ConfigError(f"config {source}: cannot resolve an interpolation: {type(exc).__name__}: {exc}") from None
    assert isinstance(resolved, dict)
    return resolved
