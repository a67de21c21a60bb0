"""Experiment trackers: every metrics-line figure as a curve in the tracker people already use.

NeMo-RL's keys: ``logger.tensorboard_enabled`` and ``logger.log_dir`` (TensorBoard event files
under ``<log_dir>/<run_id>/tensorboard``; ``tensorboard --logdir <log_dir>``). Each numeric field
of a step's ``metrics.jsonl`` line is a scalar ``train/<field>`` at that step (``val_accuracy``:
``validation/accuracy``); the resolved config is a text summary at step 0.

**One run, no duplicate or missing step.** ``metrics.jsonl`` is the record; a tracker mirrors it.
When a flow opens the tracker (a new run or a resume) it reads the last step the tracker already
has and logs the lines after it, so a crash between a metrics line and its tracker write leaves no
gap and a resumed run appends to the same curves without repeating a step.

**Never in the way.** Tracker writes run in the flow's background publisher thread; a tracker that
raises is logged as a warning and retried with the next step (its backlog is caught up from
``metrics.jsonl``), never failing or slowing the training loop.

MLflow and W&B (``logger.mlflow_enabled``, ``logger.wandb_enabled``) are not built yet.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["TensorBoardTracker", "Tracker", "TrackerSet", "open_trackers", "scalar_fields"]

logger = logging.getLogger(__name__)

#: metrics-line fields that are not curves
_SKIP = {"step", "weights_version", "rebuilt"}


def scalar_fields(row: Mapping[str, Any]) -> dict[str, float]:
    """``{tag: value}`` of the finite numeric fields of a metrics line (booleans as 0/1)."""
    out = {}
    for k, v in row.items():
        if k in _SKIP or isinstance(v, str) or v is None:
            continue
        if isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
            out["validation/accuracy" if k == "val_accuracy" else f"train/{k}"] = float(v)
    return out


class Tracker(Protocol):
    """A destination of metrics lines."""

    def last_step(self) -> int:
        """The newest step it holds (0: none)."""

    def log_step(self, step: int, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files under ``<log_dir>/<run_id>/tensorboard`` (``torch.utils.tensorboard``)."""

    def __init__(self, log_dir: str, run_id: str, config_yaml: str | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = os.path.join(log_dir, run_id, "tensorboard")
        self._last = _last_tensorboard_step(self.path)
        self._writer = SummaryWriter(self.path)
        if config_yaml and self._last == 0:
            self._writer.add_text("config", "```yaml\n" + config_yaml + "\n```", global_step=0)

    def last_step(self) -> int:
        return self._last

    def log_step(self, step: int, row: Mapping[str, Any]) -> None:
        for tag, value in scalar_fields(row).items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()
        self._last = max(self._last, step)

    def close(self) -> None:
        self._writer.close()


def _last_tensorboard_step(path: str) -> int:
    """The newest step of any scalar in the event files under ``path`` (TensorBoard's reader)."""
    if not os.path.isdir(path):
        return 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    return max((e.step for tag in acc.Tags().get("scalars", []) for e in acc.Scalars(tag)), default=0)


class TrackerSet:
    """The run's trackers; mirrors ``metrics.jsonl`` into each (see the module docstring)."""

    def __init__(self, trackers: Sequence[Any]) -> None:
        self.trackers = list(trackers)

    def sync(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Log every line newer than what each tracker holds; a tracker that fails is warned about
        and tried again at the next call."""
        for t in self.trackers:
            try:
                last = t.last_step()
                for row in rows:
                    if int(row["step"]) > last:
                        t.log_step(int(row["step"]), row)
            except Exception as exc:  # noqa: BLE001 - a tracker never fails the run
                logger.warning("tracker %s: %s (retried with the next step)", type(t).__name__, exc)

    def close(self) -> None:
        for t in self.trackers:
            try:
                t.close()
            except Exception as exc:  # noqa: BLE001
                logger.warning("closing tracker %s: %s", type(t).__name__, exc)


def open_trackers(cfg: Any, run_id: str, config_yaml: str | None = None) -> TrackerSet:
    """The trackers the config enables (``logger.tensorboard_enabled``)."""
    out: list[Any] = []
    if cfg.logger.tensorboard_enabled:
        try:
            out.append(TensorBoardTracker(cfg.logger.log_dir, run_id, config_yaml))
        except Exception as exc:  # noqa: BLE001 - no tracker is worth a failed run
            logger.warning("TensorBoard tracker not opened: %s", exc)
    return TrackerSet(out)
