"""Reading configuration YAML with bounds: the one loader for config files, saved configs and overrides.

``yaml.safe_load`` differs from what a run config needs in three ways, all fixed here:

- a mapping that repeats a key keeps the last value silently (a second ``grpo:`` section
  replaced the first one whole); here a repeated key, at any depth, is an error naming the
  file, the line and the dotted key;
- a few hundred bytes of anchors and aliases expand to 10^9 nodes ("billion laughs"), which
  validation, hashing and JSON then walk; here the document, every alias expanded, has at most
  :data:`MAX_YAML_NODES` nodes and nests at most :data:`MAX_YAML_DEPTH` deep, and a recursive
  alias is refused (all checked on the composed node graph, before any object is built);
- the input is at most :data:`MAX_CONFIG_BYTES` (a real config is a few KiB).

Every failure is one :class:`ConfigError` naming the source. Anchors, aliases and merge keys
(``<<: *defaults``) within those bounds keep working.
"""

from __future__ import annotations

import io
import os
from typing import Any

import yaml

from nrl_tasks.config.errors import ConfigError

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "ConfigError",
    "YAMLSyntaxError",
    "load_yaml_file",
    "load_yaml_text",
    "parse_yaml",
]

MAX_CONFIG_BYTES = 1 << 20
"""Largest config text read (1 MiB; ``configs/*.yaml`` are ~1-2 KiB)."""
MAX_YAML_NODES = 100_000
"""Most YAML nodes (keys, values, list items) in one document with every alias expanded (a config has ~200)."""
MAX_YAML_DEPTH = 64
"""Deepest nesting of one document with every alias expanded (a config nests ~5 deep)."""

_MERGE_TAG = "tag:yaml.org,2002:merge"
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~10x faster, nesting capped at 1000


class YAMLSyntaxError(ConfigError):
    """The text is not YAML at all (the only failure an override value falls back to a string for)."""


def parse_yaml(text: str, source: str, *, kind: str = "config file") -> Any:
    """The value of the one YAML document in ``text`` (``None`` when empty), within the bounds above.

    ``ConfigError`` starting ``{kind} {source!r}`` otherwise (:class:`YAMLSyntaxError` when it is
    not YAML).

    >>> parse_yaml("a: &x [1, 2]\\nb: *x", "c.yaml")
    {'a': [1, 2], 'b': [1, 2]}
    >>> parse_yaml("grpo: {seed: 1}\\ngrpo: {seed: 2}", "c.yaml")
    Traceback (most recent call last):
    ...
    nrl_tasks.config.errors.ConfigError: config file 'c.yaml', line 2: duplicate key grpo (first at line 1): a repeated key silently replaces the earlier one; keep one
    """
    what = f"{kind} {source!r}"
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{what} is {size} bytes, more than the {MAX_CONFIG_BYTES} a config may have")
    stream = io.StringIO(text)
    stream.name = source  # YAML error marks name the source instead of "<unicode string>"
    loader = _Loader(stream)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _Checker(loader, what).check(node)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise YAMLSyntaxError(f"{what} cannot be read as YAML: {exc}") from None
    except ConfigError:
        raise
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:  # e.g. a 5000-digit int
        raise ConfigError(f"{what} cannot be read as YAML: {type(exc).__name__}: {exc}") from None
    finally:
        loader.dispose()


def load_yaml_text(text: str, source: str, *, kind: str = "config file") -> dict[str, Any]:
    """A config mapping from YAML ``text`` read from ``source`` (a path or URI, for the messages).

    Raises ``ConfigError`` naming ``source`` when the text is too large, not YAML, empty, not a
    mapping, repeats a key or expands too far (:func:`parse_yaml`).
    """
    data = parse_yaml(text, source, kind=kind)
    if data is None:
        raise ConfigError(
            f"{kind} {source!r} is empty: expected a mapping of config sections (grpo, policy, generation, ...)"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{kind} {source!r} must hold a mapping at top level, got {type(data).__name__}")
    return data


def load_yaml_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config mapping from the local YAML file ``path`` (at most :data:`MAX_CONFIG_BYTES` are read).

    Raises ``ConfigError`` naming the file: missing, unreadable, too large, not UTF-8, or any
    problem of :func:`load_yaml_text`.
    """
    name = os.fspath(path)
    try:
        with open(name, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file {name!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {name!r} cannot be read: {exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {name!r} is larger than the {MAX_CONFIG_BYTES} bytes a config may have")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {name!r} cannot be read as YAML: not UTF-8 ({exc})") from None
    return load_yaml_text(text, name)


class _Checker:
    """One pass over the composed node graph: expanded size, depth, recursive aliases, repeated keys."""

    def __init__(self, loader: Any, what: str) -> None:
        self.loader, self.what = loader, what
        self.done: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, height)
        self.active: set[int] = set()

    def check(self, root: yaml.Node) -> None:
        nodes, _ = self._visit(root, (), 1)
        if nodes > MAX_YAML_NODES:  # pragma: no cover - _visit raises first
            raise self._too_many(nodes)

    def _too_many(self, nodes: int) -> ConfigError:
        return ConfigError(
            f"{self.what} expands to more than {MAX_YAML_NODES} YAML nodes (aliases counted once per use, "
            f"{nodes} so far): a config has a few hundred"
        )

    def _visit(self, node: yaml.Node, path: tuple[Any, ...], depth: int) -> tuple[int, int]:
        key = id(node)
        if key in self.active:
            raise ConfigError(f"{self.what}, line {node.start_mark.line + 1}: recursive YAML alias at {_dotted(path)}")
        if key in self.done:
            nodes, height = self.done[key]
        else:
            if depth > MAX_YAML_DEPTH:
                raise ConfigError(f"{self.what} nests more than {MAX_YAML_DEPTH} levels deep (at {_dotted(path)})")
            self.active.add(key)
            nodes, height = 1, 1
            if isinstance(node, yaml.MappingNode):
                self._repeated_keys(node, path)
                for k, v in node.value:
                    label = k.value if isinstance(k, yaml.ScalarNode) else "?"
                    for child in (k, v):
                        n, h = self._visit(child, path + (label,), depth + 1)
                        nodes, height = nodes + n, max(height, h + 1)
                        if nodes > MAX_YAML_NODES:
                            raise self._too_many(nodes)
            elif isinstance(node, yaml.SequenceNode):
                for i, child in enumerate(node.value):
                    n, h = self._visit(child, path + (i,), depth + 1)
                    nodes, height = nodes + n, max(height, h + 1)
                    if nodes > MAX_YAML_NODES:
                        raise self._too_many(nodes)
            self.active.discard(key)
            self.done[key] = (nodes, height)
        if depth - 1 + height > MAX_YAML_DEPTH:
            raise ConfigError(f"{self.what} nests more than {MAX_YAML_DEPTH} levels deep (at {_dotted(path)})")
        return nodes, height

    def _repeated_keys(self, node: yaml.MappingNode, path: tuple[Any, ...]) -> None:
        first: dict[Any, int] = {}
        for k, _ in node.value:
            if k.tag == _MERGE_TAG or not isinstance(k, yaml.ScalarNode):
                continue  # merged keys may be overridden; complex keys are left to the constructor
            value = self.loader.construct_object(k)  # resolved: `1` and `1.0`, `true` and `yes` collide
            try:
                seen = first.get(value)
            except TypeError:  # pragma: no cover - scalars are hashable
                continue
            line = k.start_mark.line + 1
            if seen is not None:
                raise ConfigError(
                    f"{self.what}, line {line}: duplicate key {_dotted(path + (k.value,))} (first at line {seen}): "
                    "a repeated key silently replaces the earlier one; keep one"
                )
            first[value] = line


def _dotted(path: tuple[Any, ...], most: int = 12) -> str:
    parts = [str(p) for p in path[:most]] + (["..."] if len(path) > most else [])
    return ".".join(parts) or "<top level>"
