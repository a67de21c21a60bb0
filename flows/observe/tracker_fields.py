"""What trackers log of a metrics line or an evaluation, and URL redaction (shared by
:mod:`flows.observe.trackers` and the MLflow / W&B trackers, which import nothing else of it)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["eval_fields", "redact_url", "scalar_fields"]

#: metrics-line fields that are not curves
_SKIP = {"step", "weights_version", "rebuilt"}
#: metrics-line fields of the validation, logged under ``validation/`` (the rest under ``train/``)
_VALIDATION = {"val_accuracy": "validation/accuracy", "val_turns_mean": "validation/turns_mean"}


def scalar_fields(row: Mapping[str, Any]) -> dict[str, float]:
    """``{tag: value}`` of the finite numeric fields of a metrics line (booleans as 0/1)."""
    out = {}
    for k, v in row.items():
        if k in _SKIP or isinstance(v, str) or v is None:
            continue
        if isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
            out[_VALIDATION.get(k, f"train/{k}")] = float(v)
    return out


def eval_fields(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``{"eval/<name>": value}`` of the finite numbers of an evaluation result.

    >>> eval_fields({"accuracy": 0.5, "n": 8, "split": "test", "loss": float("nan")})
    {'eval/accuracy': 0.5, 'eval/n': 8.0}
    """
    return {
        f"eval/{k}": float(v)
        for k, v in metrics.items()
        if isinstance(v, (bool, int, float)) and not isinstance(v, str) and math.isfinite(float(v))
    }


def redact_url(text: str) -> str:
    """``text`` with the userinfo of any URL in it hidden.

    >>> redact_url("http://alice:s3cret@mlflow.example:5000/x and https://tok@h/")
    'http://***@mlflow.example:5000/x and https://***@h/'
    """
    return re.sub(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@", r"\1***@", str(text))
