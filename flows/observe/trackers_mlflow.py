"""MLflow as a tracker (``logger.mlflow_enabled``, ``logger.mlflow``; see :mod:`flows.observe.trackers`).

One MLflow run per nrl run, in ``logger.mlflow.experiment_name``, found again on resume by its
tag ``nrl.run_id`` and continued (``MlflowClient`` only: no fluent, process-global active run, so
two runs in one process do not clash). The default store is SQLite,
``sqlite:///<log_dir>/mlflow/mlflow.db`` (MLflow 3.17 refuses a file store such as ``./mlruns``
unless ``MLFLOW_ALLOW_FILE_STORE=true``); ``mlflow ui --backend-store-uri <that uri>`` browses it.

**Where the curves end.** Each step's metrics go in one ``log_batch`` together with a metric
``nrl/step`` (value = step), so the run's latest ``nrl/step`` is the last step it holds: a crash
between two steps never leaves a step half-counted. After a failed write the tracker reads it back
from the server before the next one (the write may have landed before the error).

**Server down.** MLflow's HTTP client reads ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (default 120 s) and
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` (default 7, exponential backoff) from the environment at every
request, process-wide. Opening a tracker on an ``http(s)://`` URI sets them to 5 s and 0 retries
*unless they are already set* (yours win): a dead server then costs one fast failure per sync,
warned about and caught up at the next one, instead of minutes of backoff in the publisher thread.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.config import MLflowConfig
from flows.observe.tracker_fields import eval_fields, redact_url, scalar_fields
from nrl_tasks.config.base import flatten

if TYPE_CHECKING:
    from flows.config import MLflowConfig

__all__ = ["MLflowTracker", "default_tracking_uri", "flat_params"]

logger = logging.getLogger(__name__)

RUN_TAG = "nrl.run_id"
STEP_KEY = "nrl/step"
#: applied with ``os.environ.setdefault`` for http(s) tracking URIs (see the module docstring)
HTTP_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
# MLflow's limits (mlflow.utils.validation): params/tags and metrics per log_batch, lengths
_PARAMS_PER_BATCH, _METRICS_PER_BATCH, _PARAM_VALUE_LEN, _KEY_LEN = 100, 1000, 6000, 250


def default_tracking_uri(log_dir: str) -> str:
    """``sqlite:///<abs log_dir>/mlflow/mlflow.db``."""
    return "sqlite:///" + os.path.abspath(os.path.join(log_dir, "mlflow", "mlflow.db"))


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted keys and string values of a nested config, values cut to MLflow's 6000 characters
    and URL credentials redacted.

    >>> flat_params({"a": {"b": 1, "c": [1, 2]}, "d": None, "e": "http://u:p@h"})
    {'a.b': '1', 'a.c': '[1, 2]', 'd': 'None', 'e': 'http://***@h'}
    """
    def text(v: Any) -> str:
        return v if isinstance(v, str) else (json.dumps(v) if isinstance(v, (list, dict)) else str(v))

    return {key: redact_url(text(v))[:_PARAM_VALUE_LEN] for key, v in flatten(config, prefix).items()}


def _is_http(uri: str) -> bool:
    return bool(re.match(r"https?://", uri))


class MLflowTracker:
    """An MLflow run mirroring the nrl run ``run_id`` (see the module docstring)."""

    label = "MLflow"

    def __init__(
        self, log_dir: str, run_id: str, cfg: MLflowConfig | None = None, config: Mapping[str, Any] | None = None
    ) -> None:
        from mlflow.tracking import MlflowClient

        cfg = cfg or MLflowConfig()
        self.tracking_uri = cfg.tracking_uri or default_tracking_uri(log_dir)
        if _is_http(self.tracking_uri):
            for k, v in HTTP_ENV_DEFAULTS.items():
                os.environ.setdefault(k, v)
        elif self.tracking_uri.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(self.tracking_uri[len("sqlite:///"):]), exist_ok=True)
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_id = self._experiment(cfg.experiment_name, log_dir)
        run = self._find_run(run_id)
        if run is None:
            run = self._client.create_run(self.experiment_id, run_name=cfg.run_name or run_id, tags={RUN_TAG: run_id})
            logger.info("MLflow run %s created in %s", run.info.run_id, redact_url(self.tracking_uri))
        elif run.info.status != "RUNNING":
            self._client.update_run(run.info.run_id, status="RUNNING")
        self.run_id: str = run.info.run_id
        self._last = 0
        self._evals: set[tuple[str, int]] = set()
        self._read_back(run)
        if config:
            self._log_params(flat_params(config), run.data.params)

    def _experiment(self, name: str, log_dir: str) -> str:
        exp = self._client.get_experiment_by_name(name)
        if exp is None:
            artifacts = None
            if not _is_http(self.tracking_uri):  # keep a local store's artifacts beside it, not in the cwd
                artifacts = Path(os.path.abspath(os.path.join(log_dir, "mlflow", "artifacts"))).as_uri()
            try:
                return self._client.create_experiment(name, artifact_location=artifacts)
            except Exception:  # another run created it first
                exp = self._client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            self._client.restore_experiment(exp.experiment_id)
        return exp.experiment_id

    def _find_run(self, run_id: str) -> Any:
        quoted = run_id.replace("\\", "\\\\").replace("'", "\\'")
        runs = self._client.search_runs(
            [self.experiment_id], f"tags.`{RUN_TAG}` = '{quoted}'", max_results=1, order_by=["attributes.start_time ASC"]
        )
        return runs[0] if runs else None

    def _read_back(self, run: Any = None) -> None:
        """Where the run's curves end and which eval points it holds, from the run itself."""
        run = run or self._client.get_run(self.run_id)
        metrics = run.data.metrics
        self._last = int(metrics.get(STEP_KEY, 0))
        history = self._client.get_metric_history
        self._evals = {(k, int(m.step)) for k in metrics if k.startswith("eval/") for m in history(self.run_id, k)}
        self._stale = False

    def _log_params(self, params: dict[str, str], logged: Mapping[str, str]) -> None:
        """Params the run lacks (MLflow refuses to change a logged value: a resume with other
        overrides keeps the first values; the run's ``config.yaml`` has the resumed ones)."""
        from mlflow.entities import Param

        new = [Param(k, v) for k, v in params.items() if k not in logged and len(k) <= _KEY_LEN]
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            logger.info("MLflow keeps the first values of %d changed config keys: %s", len(changed), ", ".join(changed[:8]))
        for i in range(0, len(new), _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=new[i : i + _PARAMS_PER_BATCH], synchronous=True)

    def _log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(k, v, ts, step) for k, v in values.items() if math.isfinite(v)]
        try:
            for i in range(0, len(metrics), _METRICS_PER_BATCH):
                self._client.log_batch(self.run_id, metrics=metrics[i : i + _METRICS_PER_BATCH], synchronous=True)
        except Exception:
            self._stale = True  # it may have landed: read back before writing again
            raise

    def last_step(self) -> int:
        if self._stale:
            self._read_back()
        return self._last

    def log_step(self, step: int, row: Mapping[str, Any]) -> None:
        if self._stale:
            self._read_back()
        if step <= self._last:
            return
        self._log(step, {**scalar_fields(row), STEP_KEY: float(step)})  # the step marker last
        self._last = step

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._stale:
            self._read_back()
        new = {k: v for k, v in eval_fields(metrics).items() if (k, step) not in self._evals}
        if new:
            self._log(step, new)
            self._evals.update((k, step) for k in new)

    def link(self) -> tuple[str, str]:
        if _is_http(self.tracking_uri):
            base = redact_url(self.tracking_uri).replace("***@", "").rstrip("/")
            return self.label, f"{base}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return self.label, self.tracking_uri

    def close(self) -> None:
        self._client.set_terminated(self.run_id, "FINISHED")
