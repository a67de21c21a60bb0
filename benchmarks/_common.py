"""Shared set-up of the ``bench_*`` benchmarks: a quiet, offline environment and best-of timing."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any


def quiet_env(prefect_home: str | None = None) -> None:
    """Default the environment to quiet and offline; call before Prefect, Ray or HF are imported.

    The ``nrl`` CLI's defaults (no Prefect analytics, no Ray usage stats, no tokenizer
    threads, HF hub offline, patient ephemeral Prefect server) plus Prefect logs at WARNING
    and Ray token auth off. ``prefect_home``: where Prefect keeps its state (e.g. a temp dir).
    Only unset variables are changed.
    """
    from flows.cli import _quiet_env

    if prefect_home is not None:
        os.environ.setdefault("PREFECT_HOME", prefect_home)
    _quiet_env()
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """``(fastest wall seconds of repeats calls of fn, the last call's result)``."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def smollm2_available() -> bool:
    """Whether ``builtin:smollm2`` resolves (the offline SmolLM2-135M package, ``make smollm2``)."""
    from flows.models import resolve_model_path

    try:
        resolve_model_path("builtin:smollm2")  # converted once from the offline package
        return True
    except Exception:  # noqa: BLE001 - the package is optional: reported, not fatal
        return False


def val_accuracy(root: str, run_id: str, step: int) -> float | None:
    """The held-out accuracy recorded by the validation at ``step`` of a run (``None``: none committed)."""
    import storage

    uri = os.path.join(root, run_id, "steps", f"step_{step:06d}", "val")
    if not storage.is_committed(uri):
        return None
    return storage.read_manifest(uri).meta.get("val_accuracy")
