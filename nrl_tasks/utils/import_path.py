"""Finding a user's plug-in by its import path (``package.module:attr.path``): the reward
function (``env.reward_fn``) and the environment class (``env.environment``)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_attribute"]


def import_attribute(module_name: str, attr_path: str, label: str) -> Any:
    """``module_name``'s attribute ``attr_path`` (dotted); ``ValueError`` starting with ``label``
    (e.g. ``"reward_fn 'pkg.mod:fn'"``) when the module cannot be imported or lacks the attribute.

    >>> import_attribute("os.path", "join", "x").__name__
    'join'
    """
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{label}: cannot import module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{label}: module {module_name!r} has no attribute {attr_path!r}") from None
    return obj
