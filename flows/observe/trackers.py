"""Experiment trackers: every metrics-line figure as a curve in the tracker people already use.

NeMo-RL's keys: ``logger.tensorboard_enabled``, ``logger.mlflow_enabled`` (+ ``logger.mlflow``:
``experiment_name``, ``run_name``, ``tracking_uri``), ``logger.wandb_enabled`` (+ ``logger.wandb``:
``project``, ``name``) and ``logger.log_dir``. Each numeric field of a step's ``metrics.jsonl``
line is a scalar ``train/<field>`` at that step (``val_accuracy``: ``validation/accuracy``);
evaluations of the checkpoint of training step ``s`` are ``eval/<name>`` at step ``s`` in the same
tracker run; the resolved config is a text summary at step 0 (TensorBoard), the run's parameters
(MLflow, dotted keys) or its config (W&B).

- TensorBoard (here): event files under ``<log_dir>/<run_id>/tensorboard``.
- MLflow (:mod:`flows.observe.trackers_mlflow`): a server (``http(s)://``) or by default a SQLite store
  ``<log_dir>/mlflow/mlflow.db``; the run is found again by its tag ``nrl.run_id``.
- W&B (:mod:`flows.observe.trackers_wandb`): offline unless ``WANDB_MODE`` says otherwise, files under
  ``<log_dir>/<run_id>/wandb`` (``wandb sync`` uploads them); a run id derived from ours.

**One run, no duplicate or missing step.** ``metrics.jsonl`` is the record; a tracker mirrors it.
When a flow opens the tracker (a new run or a resume) it reads the last step the tracker already
has (from the tracker's own data: event files, the MLflow run, the ``.wandb`` logs) and logs the
lines after it, so a crash between a metrics line and its tracker write leaves no gap and a
resumed run appends to the same curves without repeating a step. An evaluation point
(``eval/<name>``, step) is logged once however often it is offered.

**Never in the way.** Tracker writes run in the flow's background publisher thread; a tracker that
raises is logged as a warning and retried with the next step (its backlog is caught up from
``metrics.jsonl``; evaluations it missed are kept and offered again), never failing or slowing
the training loop. A tracker that cannot open is warned about and left out. MLflow's HTTP client
gets a short timeout and no retries (see :mod:`flows.observe.trackers_mlflow`). Credentials in URLs
(``user:pass@``) never reach logs, parameters or links.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from flows.observe.tracker_fields import eval_fields, redact_url, scalar_fields

if TYPE_CHECKING:  # pragma: no cover - typing only
    from nrl_tasks.config.master import MasterConfig

__all__ = [
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "TrackerSet",
    "WandbTracker",
    "eval_fields",
    "open_trackers",
    "publish_tracker_links",
    "redact_url",
    "scalar_fields",
]

logger = logging.getLogger(__name__)


class Tracker(Protocol):
    """A destination of metrics lines."""

    def last_step(self) -> int:
        """The newest training step it holds (0: none)."""

    def log_step(self, step: int, row: Mapping[str, Any]) -> None: ...

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """Evaluation of the checkpoint of training step ``step`` as ``eval/<name>`` points; a point
        it already holds is not logged again."""

    def link(self) -> tuple[str, str] | None:
        """``(label, url or local path)`` of the tracker run."""

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files under ``<log_dir>/<run_id>/tensorboard`` (``torch.utils.tensorboard``)."""

    label = "TensorBoard"

    def __init__(self, log_dir: str, run_id: str, config_yaml: str | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = os.path.join(log_dir, run_id, "tensorboard")
        self._last, self._evals = _tensorboard_points(self.path)
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

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        new = {k: v for k, v in eval_fields(metrics).items() if (k, step) not in self._evals}
        for tag, value in new.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()
        self._evals.update((k, step) for k in new)

    def link(self) -> tuple[str, str]:
        return self.label, os.path.abspath(self.path)

    def close(self) -> None:
        self._writer.close()


def _tensorboard_points(path: str) -> tuple[int, set[tuple[str, int]]]:
    """The newest training step of any scalar in the event files under ``path`` and the
    ``(eval tag, step)`` points they hold (TensorBoard's reader)."""
    if not os.path.isdir(path):
        return 0, set()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    last = max((e.step for tag in tags if not tag.startswith("eval/") for e in acc.Scalars(tag)), default=0)
    return last, {(tag, e.step) for tag in tags if tag.startswith("eval/") for e in acc.Scalars(tag)}


class TrackerSet:
    """The run's trackers; mirrors ``metrics.jsonl`` into each (see the module docstring)."""

    def __init__(self, trackers: Sequence[Any]) -> None:
        self.trackers = list(trackers)
        self._pending_evals: dict[int, dict[int, dict[str, float]]] = {}  # tracker index -> step -> metrics

    def sync(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Log every line newer than what each tracker holds; a tracker that fails is warned about
        and tried again at the next call (evaluations it missed too)."""
        for i, t in enumerate(self.trackers):
            try:
                last = t.last_step()
                for row in rows:
                    if int(row["step"]) > last:
                        t.log_step(int(row["step"]), row)
                self._flush_evals(i, t)
            except Exception as exc:  # noqa: BLE001 - a tracker never fails the run
                _warn(t, exc, "retried with the next step")

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        """Evaluation of the checkpoint of training step ``step`` into each tracker; one that
        fails keeps it and is offered it again at the next call. Like :meth:`sync`, call it from
        one thread (the flow's publisher: ``publisher.submit(trackers.log_eval, step, metrics)``)."""
        for i, t in enumerate(self.trackers):
            self._pending_evals.setdefault(i, {}).setdefault(int(step), {}).update(metrics)
            try:
                self._flush_evals(i, t)
            except Exception as exc:  # noqa: BLE001
                _warn(t, exc, "evaluation kept, retried with the next sync")

    def _flush_evals(self, i: int, t: Any) -> None:
        pending = self._pending_evals.get(i, {})
        while pending:
            step = min(pending)
            if hasattr(t, "log_eval"):
                t.log_eval(step, pending[step])
            del pending[step]

    def links(self) -> dict[str, str]:
        """``{label: url or local path}`` of each tracker run."""
        out = {}
        for t in self.trackers:
            try:
                got = t.link() if hasattr(t, "link") else None
            except Exception as exc:  # noqa: BLE001
                _warn(t, exc, "no link")
                continue
            if got:
                out[got[0]] = got[1]
        return out

    def close(self) -> None:
        for t in self.trackers:
            try:
                t.close()
            except Exception as exc:  # noqa: BLE001
                logger.warning("closing tracker %s: %s", type(t).__name__, redact_url(str(exc)))


def _warn(tracker: Any, exc: BaseException, what: str) -> None:
    logger.warning("tracker %s: %s (%s)", type(tracker).__name__, redact_url(str(exc)), what)


def _config_dict(cfg: MasterConfig, config_yaml: str | None) -> dict[str, Any]:
    """The resolved config as a nested dict: ``config_yaml`` parsed (credentials already
    redacted, with its hash) or else ``cfg`` dumped with ``storage`` redacted; URL credentials
    (a tracking URI's ``user:pass@``) hidden either way."""
    data = None
    if config_yaml:
        import yaml

        data = yaml.safe_load(config_yaml)
    if not isinstance(data, dict):
        from nrl_tasks.config.credentials import redact

        data = cfg.model_dump(mode="json")
        if "storage" in data:
            data["storage"] = redact(data["storage"])
    return _redact_urls(data)


def _redact_urls(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _redact_urls(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redact_urls(v) for v in obj]
    return redact_url(obj) if isinstance(obj, str) else obj


def open_trackers(cfg: MasterConfig, run_id: str, config_yaml: str | None = None) -> TrackerSet:
    """The trackers the config enables (``logger.{tensorboard,mlflow,wandb}_enabled``); one that
    cannot open is warned about and left out."""
    lg = cfg.logger
    out: list[Any] = []

    def add(name: str, make: Any) -> None:
        try:
            out.append(make())
        except Exception as exc:  # noqa: BLE001 - no tracker is worth a failed run
            logger.warning("%s tracker not opened: %s", name, redact_url(str(exc)))

    if lg.tensorboard_enabled:
        add("TensorBoard", lambda: TensorBoardTracker(lg.log_dir, run_id, config_yaml))
    if lg.mlflow_enabled:
        from flows.observe.trackers_mlflow import MLflowTracker  # imports mlflow when it opens

        add("MLflow", lambda: MLflowTracker(lg.log_dir, run_id, lg.mlflow, _config_dict(cfg, config_yaml)))
    if lg.wandb_enabled:
        from flows.observe.trackers_wandb import WandbTracker  # imports wandb when it opens

        add("W&B", lambda: WandbTracker(lg.log_dir, run_id, lg.wandb, _config_dict(cfg, config_yaml)))
    return TrackerSet(out)


def publish_tracker_links(links: Mapping[str, str], run_id: str | None = None) -> None:
    """A Prefect link artifact (key ``nrl-<run_id>-<label>``) for each http(s) tracker link, when
    called inside a flow or task run; ``run_id`` defaults to the flow run's name. Never raises."""
    try:
        from prefect.artifacts import create_link_artifact
        from prefect.context import FlowRunContext

        from flows.observe.artifacts import _in_run_context, artifact_key

        if not _in_run_context():
            return
        if run_id is None:
            ctx = FlowRunContext.get()
            run_id = ctx.flow_run.name if ctx and ctx.flow_run else "run"
        for label, url in links.items():
            if not re.match(r"https?://", url):
                continue
            create_link_artifact(
                link=redact_url(url),
                link_text=f"{label} run",
                key=artifact_key(run_id, {"W&B": "wandb"}.get(label, label)),
                description=f"{label} run of {run_id}",
            )
    except Exception as exc:  # noqa: BLE001 - links are cosmetic
        logger.warning("tracker links not published: %s", redact_url(str(exc)))


def __getattr__(name: str) -> Any:
    # the MLflow and W&B trackers live in their own modules, imported only when asked for
    if name == "MLflowTracker":
        from flows.observe.trackers_mlflow import MLflowTracker

        return MLflowTracker
    if name == "WandbTracker":
        from flows.observe.trackers_wandb import WandbTracker

        return WandbTracker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
