"""Quiet flow-run logs: the step line stands out.

Prefect logs ``Finished in state Completed()`` at INFO for every task run and subflow run, about
6.5 lines a GRPO step, so the one useful line per step (``[run] step 7/300 reward ...``) is buried
in the flow run's log. :func:`quiet_lifecycle_logs` drops exactly those lines (completed runs, INFO)
while a flow runs, unless ``logger.log_level`` is ``DEBUG``; every other line stays: a task that
fails, crashes or is retried still logs its state at ERROR, and the stages' warnings are kept.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LifecycleFilter", "quiet_lifecycle_logs"]

#: the loggers Prefect's task and flow engines report run states on
ENGINE_LOGGERS = ("prefect.task_runs", "prefect.flow_runs")


class LifecycleFilter(logging.Filter):
    """Drops ``Finished in state Completed...`` records at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and record.getMessage().startswith("Finished in state Completed"))


@contextmanager
def quiet_lifecycle_logs(log_level: str = "INFO") -> Iterator[None]:
    """Filter the completed-run lines of Prefect's engines while the block runs (not at ``DEBUG``)."""
    if log_level == "DEBUG":
        yield
        return
    f, loggers = LifecycleFilter(), [logging.getLogger(n) for n in ENGINE_LOGGERS]
    for lg in loggers:
        lg.addFilter(f)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(f)
