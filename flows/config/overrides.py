"""Dotted ``key=value`` overrides applied to a nested config dict (before validation).

Values are parsed as YAML scalars/flow collections (``3`` → int, ``1e-5`` and ``1e8`` → float,
``true`` → bool, ``null`` → None, ``[1,2]`` → list); anything else stays a string. They are read
by the config loader (:func:`flows.config.io.parse_yaml`: bounded, no repeated keys); whether the
value fits the key (``grpo.max_num_steps=true`` is not a number) is decided at validation.

>>> apply_overrides({"grpo": {"max_num_steps": 10}}, ["grpo.max_num_steps=3", "policy.optimizer.kwargs.lr=1e-5"])
{'grpo': {'max_num_steps': 3}, 'policy': {'optimizer': {'kwargs': {'lr': 1e-05}}}}
"""

from __future__ import annotations

import copy
import re
from typing import Any, Iterable

from flows.config.io import ConfigError, YAMLSyntaxError, parse_yaml
from nrl_tasks.config.master import section_of

__all__ = ["apply_overrides", "check_overrides_apply", "parse_override", "parse_value"]

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def parse_value(text: str, key: str = "value") -> Any:
    """Parse one override value (``key`` names it in errors).

    YAML 1.1 reads ``1e-5`` as a string; we read it as a float. Text that is not YAML stays a
    string; YAML over the loader's bounds (repeated keys, alias expansion) is a ``ValueError``.

    >>> parse_value("1e-5"), parse_value("true"), parse_value("null"), parse_value("a b")
    (1e-05, True, None, 'a b')
    """
    stripped = text.strip()
    if _FLOAT_RE.match(stripped) and not stripped.lstrip("+-").isdigit():
        return float(stripped)
    try:
        return parse_yaml(stripped, key, kind="override") if stripped else ""
    except YAMLSyntaxError:
        return text


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into (``["a", "b", "c"]``, parsed value)."""
    if "=" not in item:
        raise ValueError(f"override {item!r} is not of the form key=value (e.g. grpo.max_num_steps=3)")
    key, value = item.split("=", 1)
    key = key.strip()
    if not _KEY_RE.match(key):
        raise ValueError(f"override key {key!r} is not a dotted name (e.g. policy.optimizer.kwargs.lr)")
    try:
        return key.split("."), parse_value(value, key)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a deep copy of ``data`` with every ``key=value`` override applied in order.

    A key path through a non-mapping value raises ``ValueError`` naming the key.
    Unknown keys are created here and rejected later by the pydantic models.
    """
    out = copy.deepcopy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ValueError(
                    f"override {item!r}: {'.'.join(path[: i + 1])} is a {type(nxt).__name__}, not a section"
                )
            node = nxt
        node[path[-1]] = value
    return out


def check_overrides_apply(overrides: Iterable[str], kind: str, unread: Iterable[str]) -> None:
    """``ValueError`` naming every override of a section in ``unread``, the sections a run of
    ``kind`` never reads (its recipe's ``unread_sections``): it would change nothing, silently.

    >>> check_overrides_apply(["grpo.max_num_steps=3", "policy.precision=float32"], "grpo", ("dpo",))
    >>> check_overrides_apply(["grpo.max_num_steps=10"], "dpo", ("grpo", "loss_fn"))
    Traceback (most recent call last):
    ...
    ValueError: override grpo.max_num_steps=10 does not apply to a DPO run (it never reads `grpo`, `loss_fn`; its length is dpo.max_num_steps)
    """
    unread = tuple(unread)
    bad = [item for item in overrides if item.partition("=")[0].strip().partition(".")[0] in unread]
    if bad:
        sections = ", ".join(f"`{s}`" for s in unread)
        raise ValueError(
            f"override{'s' if len(bad) > 1 else ''} {', '.join(bad)} {'do' if len(bad) > 1 else 'does'} not apply to a "
            f"{kind.upper()} run (it never reads {sections}; its length is {section_of(kind)}.max_num_steps)"
        )
