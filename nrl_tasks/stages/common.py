"""Manifest helpers shared by the flow layer (the stage skeleton itself is :mod:`nrl_tasks.stages.runner`).

:func:`committed` returns the summary dict of an already committed dataset (``uri, rows, step,
stage, weights_version, checksum`` plus the stage's figures), ``None`` if there is none;
:func:`manifest_dict` builds it from a manifest already read.
"""

from __future__ import annotations

from typing import Any

from nrl_tasks.stages.refs import DatasetRef
from nrl_tasks.stages.runner import TASK_DEFAULTS, StageTimer, committed_ref

__all__ = ["TASK_DEFAULTS", "StageTimer", "committed", "manifest_dict", "stage_meta"]


def stage_meta(manifest: Any) -> dict[str, Any]:
    """The user metadata (``**meta`` of ``save_batch``) stored in a manifest."""
    return dict(manifest.meta or {})


def manifest_dict(manifest: Any, uri: str) -> dict[str, Any]:
    """Small JSON-able summary of a committed dataset: ``uri, rows, step, stage, weights_version,
    checksum`` plus the stage metadata (figures such as ``seconds``)."""
    return DatasetRef.from_manifest(manifest, uri).summary()


def committed(uri: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The manifest dict of the committed dataset at ``uri``, or ``None`` if there is none."""
    ref = committed_ref(uri, storage_options)
    return None if ref is None else ref.summary()
