"""Per-component time of GRPO flow steps, for ``bench_pipeline``.

:class:`FlowSpans` wraps a few functions of the flow process with wall-clock counters while it
is active (``with FlowSpans() as spans: grpo(...)``) and snapshots them at the start of every
step (``flows.algorithms.driver.StepDriver._begin``) and at its end (after the ``apply_retention`` that closes it); a step's
seconds per component are the differences. The components are exclusive (none is counted
inside another one), so ``other`` is the step wall time minus all of them (actor work and
stage glue included; the benchmark subtracts the actor work recorded in ``metrics.jsonl``).

Measurement only: the wrapped functions run unchanged; everything is restored on exit.
"""

from __future__ import annotations

import collections
import functools
import os
import statistics
import time
from typing import Any, Callable

__all__ = ["COMPONENTS", "FlowSpans"]

#: component -> what it covers (the table's rows, in order)
COMPONENTS: dict[str, str] = {
    "prefect_task": "Prefect task machinery (task call minus the task function)",
    "prefect_subflow": "step subflow machinery (grouping: subflow call minus its body)",
    "save": "save_batch (encode, write, commit)",
    "fsync": "  of which fsync (shards, manifest, directories; metrics file too)",
    "load": "load_batch (read manifest, map, verify, decode)",
    "commit_checks": "is_committed / read_manifest (stage idempotency checks)",
    "probes": "actor health/version probes (recovery planning only)",
    "checksum": "policy weights checksum after train",
    "metrics": "metrics.jsonl upsert + artifact hand-off",
}


class FlowSpans:
    """Wall-clock counters around the flow's persistence, Prefect and probe calls (see module doc)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self.steps: list[tuple[Any, Any]] = []  # (snapshot at step start, snapshot at step end)
        self._begin: Any = None
        self._undo: list[tuple[Any, str, Any]] = []
        self._server: Any = None

    # ------------------------------------------------------------------ patching
    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - t
                self.calls[name] += 1

        return wrapper

    def _patch(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        old = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if old is None:
            return  # renamed or absent: that component reads 0
        self._undo.append((owner, attr, old))
        setattr(owner, attr, make(old))

    def _time(self, owner: Any, attr: str, name: str) -> None:
        self._patch(owner, attr, lambda old: self._timed(name, old))

    def __enter__(self) -> FlowSpans:
        import prefect.flow_engine as flow_engine
        import prefect.flows
        import prefect.task_engine as engine
        import prefect.tasks
        import storage

        import flows.algorithms.training as training
        import flows.algorithms.driver as driver
        import flows.algorithms.step as step
        from flows.observe.artifacts import BackgroundPublisher
        from nrl_tasks.models.policy import lm_policy_refit
        from nrl_tasks.stages import health

        spans = self

        def machinery(name: str, body: str) -> Callable[[Any], Any]:
            def wrap(old: Any) -> Any:
                @functools.wraps(old)
                def call(obj: Any, *args: Any, **kwargs: Any) -> Any:
                    body0 = spans.total[body]
                    t = time.perf_counter()
                    try:
                        return old(obj, *args, **kwargs)
                    finally:
                        outer = time.perf_counter() - t
                        spans.total[name] += outer - (spans.total[body] - body0)

                return call

            return wrap

        def fsync(old: Any) -> Any:
            return self._timed("fsync", old)

        self._patch(prefect.tasks.Task, "__call__", machinery("prefect_task", "_body"))
        self._time(engine, "call_with_parameters", "_body")
        # the step subflow's own cost: its call minus its body (the tasks inside count as above)
        self._patch(prefect.flows.Flow, "__call__", machinery("prefect_subflow", "_flow_body"))
        self._time(flow_engine, "call_with_parameters", "_flow_body")
        self._patch(os, "fsync", fsync)
        self._time(storage, "save_batch", "save")
        self._time(storage, "load_batch", "load")
        self._time(storage, "is_committed", "commit_checks")
        self._time(storage, "read_manifest", "commit_checks")
        self._time(health, "probe_actors", "probes")
        self._time(lm_policy_refit.PolicyRefitMethods, "weights_checksum", "checksum")
        self._time(step, "upsert_metrics", "metrics")
        self._time(BackgroundPublisher, "submit", "metrics")
        # a step: from its start in the step driver to the end of the retention check that closes it
        self._patch(driver.StepDriver, "_begin", lambda old: self._marking(old, before=True))
        self._patch(training, "apply_retention", lambda old: self._marking(old, before=False))
        return self

    def _marking(self, old: Callable[..., Any], *, before: bool) -> Callable[..., Any]:
        @functools.wraps(old)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before:
                self._begin = self.snapshot()
                return old(*args, **kwargs)
            out = old(*args, **kwargs)
            if self._begin is not None:
                self.steps.append((self._begin, self.snapshot()))
                self._begin = None
            return out

        return wrapper

    def __exit__(self, *exc: Any) -> None:
        for owner, attr, old in reversed(self._undo):
            setattr(owner, attr, old)
        self._undo.clear()

    # ------------------------------------------------------------------ snapshots
    def _server_cpu(self) -> float:
        """CPU seconds of this process's Prefect server subprocess (the ephemeral API), if any."""
        try:
            import psutil

            if self._server is None:
                for p in psutil.Process().children(recursive=True):
                    if "prefect.server" in " ".join(p.cmdline()):
                        self._server = p
                        break
            if self._server is None:
                return 0.0
            c = self._server.cpu_times()
            return c.user + c.system
        except Exception:  # noqa: BLE001 - optional figure
            return 0.0

    def snapshot(self) -> tuple[float, float, float, dict[str, float]]:
        return time.perf_counter(), time.process_time(), self._server_cpu(), dict(self.total)

    def per_step(self) -> list[dict[str, float]]:
        """Seconds per component of each step (``wall``, ``cpu_flow``: CPU of the flow process,
        ``cpu_server``: CPU of its Prefect server subprocess, ``other``: wall minus the components)."""
        out = []
        for (w0, c0, s0, t0), (w1, c1, s1, t1) in self.steps:
            row = {k: t1.get(k, 0.0) - t0.get(k, 0.0) for k in COMPONENTS}
            row.update(wall=w1 - w0, cpu_flow=c1 - c0, cpu_server=s1 - s0)
            row["other"] = row["wall"] - sum(v for k, v in row.items() if k in COMPONENTS and k != "fsync")
            out.append(row)
        return out

    @staticmethod
    def medians(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
