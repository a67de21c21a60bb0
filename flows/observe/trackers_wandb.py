"""Weights & Biases as a tracker (``logger.wandb_enabled``, ``logger.wandb``; see :mod:`flows.observe.trackers`).

Offline unless ``WANDB_MODE`` says otherwise: the run's files go under
``<log_dir>/<run_id>/wandb/offline-run-<time>-<id>/`` and need no network (``wandb sync`` uploads
them later). The W&B run id is derived from ours (:func:`wandb_run_id`) and opened with
``resume="allow"``, so a resumed nrl run continues the same W&B run; each process adds one
``offline-run-*`` folder of that id.

Steps: training curves use the x-axis ``trainer/step`` (our step) and evaluations ``eval/step``
(the training step of the evaluated checkpoint), declared with ``define_metric``; W&B's own
``_step`` only counts ``log`` calls, so an evaluation that arrives after later training steps is
not dropped.

**Where the curves end.** Offline W&B has no server to ask, so on open the tracker reads the
run's ``.wandb`` logs (W&B's LevelDB-style record log of ``wandb_internal_pb2.Record``; wandb
0.31 ships no Python reader, ``wandb leet inspect --json`` prints the same records) for the
largest ``trainer/step`` and the ``eval/*`` points already logged. What a crash kept W&B from
writing is not in those logs and is logged again; nothing is logged twice. ``run.finish()``
returns before wandb-core has flushed the log, so :meth:`WandbTracker.close` waits (bounded) until
the log holds what it logged: a resume in the same process then reads a complete log.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import struct
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from flows.config import WandbConfig
from flows.observe.tracker_fields import eval_fields, scalar_fields

if TYPE_CHECKING:
    from flows.config import WandbConfig

__all__ = ["WandbTracker", "logged_points", "wandb_records", "wandb_run_id"]

logger = logging.getLogger(__name__)

STEP_KEY, EVAL_STEP_KEY = "trainer/step", "eval/step"
_BLOCK, _HEADER = 32768, 7  # LevelDB log: 32 KiB blocks, records with a crc32c/length/type header


def wandb_run_id(run_id: str) -> str:
    """A W&B run id derived from ours: stable, W&B-safe characters, distinct for distinct ids.

    >>> wandb_run_id("grpo/tiny:1")
    'grpo-tiny-1-e8000cca'
    """
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", run_id).strip("-")[:48] or "run"
    return f"{slug}-{hashlib.blake2b(run_id.encode(), digest_size=4).hexdigest()}"


def wandb_records(path: str) -> Iterator[Any]:
    """The records (``wandb_internal_pb2.Record``) of one ``.wandb`` file; a torn tail is ignored."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        return
    pos, buf = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        _crc, length, record_type = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if record_type == 0:  # zero fill (preallocated or padded)
            pos += left
            continue
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if len(chunk) < length:
            return
        buf = chunk if record_type in (1, 2) else buf + chunk  # 1 full, 2 first, 3 middle, 4 last
        if record_type in (2, 3):
            continue
        record = pb.Record()
        try:
            record.ParseFromString(buf)
        except Exception:  # noqa: BLE001 - a torn record at the tail
            return
        yield record


def logged_points(wandb_dir: str, wandb_id: str) -> tuple[int, set[tuple[str, int]]]:
    """The largest ``trainer/step`` and the ``(eval key, step)`` points in all ``.wandb`` logs of
    run ``wandb_id`` under ``wandb_dir``."""
    last, evals = 0, set()
    for path in sorted(glob.glob(os.path.join(wandb_dir, f"*run-*-{wandb_id}", f"run-{wandb_id}.wandb"))):
        got = _file_points(path)
        last, evals = max(last, got[0]), evals | got[1]
    return last, evals


def _file_points(path: str) -> tuple[int, set[tuple[str, int]]]:
    last, evals = 0, set()
    for record in wandb_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        item = {(i.key or "/".join(i.nested_key)): i.value_json for i in record.history.item}
        if STEP_KEY in item:
            last = max(last, int(float(json.loads(item[STEP_KEY]))))
        if EVAL_STEP_KEY in item:
            step = int(float(json.loads(item[EVAL_STEP_KEY])))
            evals.update((k, step) for k in item if k.startswith("eval/") and k != EVAL_STEP_KEY)
    return last, evals


class WandbTracker:
    """A W&B run (offline by default) mirroring the nrl run ``run_id`` (see the module docstring)."""

    label = "W&B"

    def __init__(
        self, log_dir: str, run_id: str, cfg: WandbConfig | None = None, config: Mapping[str, Any] | None = None
    ) -> None:
        import wandb

        cfg = cfg or WandbConfig()
        self.path = os.path.abspath(os.path.join(log_dir, run_id))
        os.makedirs(self.path, exist_ok=True)
        self.wandb_id = wandb_run_id(run_id)
        self._last, self._evals = logged_points(os.path.join(self.path, "wandb"), self.wandb_id)
        self._session: set[tuple[str, int]] = set()  # points logged by this object: (trainer/step, s) or (eval key, s)
        self._run = wandb.init(
            project=cfg.project,
            name=cfg.name or run_id,
            id=self.wandb_id,
            resume="allow",
            dir=self.path,
            config=dict(config or {}),
            mode=None if os.environ.get("WANDB_MODE") else "offline",
            reinit="create_new",  # a run object of its own: two trackers in one process do not clash
            settings=wandb.Settings(silent=True, console="off", disable_git=True, save_code=False, x_disable_stats=True),
        )
        self._run.define_metric(STEP_KEY)
        self._run.define_metric(EVAL_STEP_KEY)
        for prefix in ("train", "validation"):
            self._run.define_metric(f"{prefix}/*", step_metric=STEP_KEY)
        self._run.define_metric("eval/*", step_metric=EVAL_STEP_KEY)

    def last_step(self) -> int:
        return self._last

    def log_step(self, step: int, row: Mapping[str, Any]) -> None:
        if step <= self._last:
            return
        self._run.log({**scalar_fields(row), STEP_KEY: step})
        self._last = step
        self._session.add((STEP_KEY, step))

    def log_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        new = {k: v for k, v in eval_fields(metrics).items() if (k, step) not in self._evals}
        if new:
            self._run.log({**new, EVAL_STEP_KEY: step})
            self._evals.update((k, step) for k in new)
            self._session.update((k, step) for k in new)

    def link(self) -> tuple[str, str]:
        url = None if self._run.offline else self._run.url
        return self.label, url or os.path.join(self.path, "wandb")

    def close(self, flush_timeout_s: float = 30.0) -> None:
        """Finish the run and wait (bounded) until its ``.wandb`` log holds what this object logged:
        ``finish()`` returns before wandb-core has flushed the log, and a resume in this same
        process reads that log."""
        self._run.finish()
        if not self._session:
            return
        want_last = max((s for k, s in self._session if k == STEP_KEY), default=0)
        want_evals = {p for p in self._session if p[0] != STEP_KEY}
        path, deadline = self._run.settings.sync_file, time.monotonic() + flush_timeout_s
        while True:
            last, evals = _file_points(path) if os.path.exists(path) else (0, set())
            if last >= want_last and want_evals <= evals:
                return
            if time.monotonic() > deadline:
                logger.warning("W&B log %s not flushed after %.0f s", path, flush_timeout_s)
                return
            time.sleep(0.05)
