"""How ``nrl`` runs a flow: the exit status of a run that does not finish (an exception, or
``SystemExit`` / ``KeyboardInterrupt`` raised by user code: 1; SIGINT: 130; SIGTERM: 143, both
stopping the flow cleanly), the resume hint, and the summary of one that did."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from typing import Any, Self

from nrl_tasks.stages.errors import exception_chain

__all__ = ["EXIT_FAILED", "EXIT_GATED", "EXIT_SIGINT", "EXIT_SIGTERM", "print_summary", "run_flow", "run_pipeline_flow"]

EXIT_FAILED = 1
EXIT_SIGINT = 130
EXIT_SIGTERM = 143
#: a pipeline stopped at a gate (not a failure: ``nrl resume`` goes on from there)
EXIT_GATED = 3


class _StopSignals:
    """SIGINT and SIGTERM while a run's flow runs: each stops the flow like Ctrl-C (the flow
    unwinds: actors, local Ray), and which one came decides the exit status, whatever exception
    Prefect turns it into on the way out (a signal landing inside Prefect's task set-up comes out
    as another error chained to it). A second signal during that clean-up ends the process."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame: object) -> None:
        from prefect.exceptions import TerminationSignal

        self.received = signum
        signal.signal(signum, signal.SIG_DFL)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise TerminationSignal(signum)

    def __enter__(self) -> Self:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may set handlers (the caller's then apply)
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _signal_in(exc: BaseException) -> int | None:
    """The signal a ``TerminationSignal`` in ``exc``'s chain stands for. During a flow run Prefect's
    own SIGTERM handler replaces ours and re-sends the signal to ours only when a bare
    ``TerminationSignal`` leaves the flow; one raised while C code ran (inside ``ray.get``) leaves
    as ``SystemError: <built-in method ...> returned a result with an exception set`` caused by it."""
    from prefect.exceptions import TerminationSignal

    return next((e.signal for e in exception_chain(exc) if isinstance(e, TerminationSignal)), None)


def run_flow(call: Callable[[], dict[str, Any]], layout: Any, *, summary: bool = True) -> int:
    """Run the flow; exit status 0 only when it returned. Whatever ends it early (an exception,
    ``SystemExit`` or ``KeyboardInterrupt`` from user code such as a reward plug-in, SIGINT,
    SIGTERM) is printed after the resume hint (or, for a refused run lease, the take-over advice),
    as the last line, naming the root cause through Ray's wrappers (:func:`describe_error`):
    130 (SIGINT), 143 (SIGTERM), else 1."""
    hint = f"nrl: resume with `nrl resume {layout.run_id} --storage {layout.root}`"
    t0 = time.perf_counter()
    with _StopSignals() as signals:
        try:
            result = call()
        except BaseException as exc:  # noqa: BLE001 - SystemExit from user code too; no Prefect traceback twice
            from flows.run.lease import lease_refusal
            from nrl_tasks.stages.errors import describe_error

            held = lease_refusal(exc)
            print(f"nrl: {held}" if held is not None else hint, file=sys.stderr)
            signals.received = signals.received or _signal_in(exc)
            if signals.received == signal.SIGTERM:
                print(f"nrl: run {layout.run_id} stopped by SIGTERM", file=sys.stderr)
            elif signals.received == signal.SIGINT or isinstance(exc, KeyboardInterrupt):
                print(f"nrl: run {layout.run_id} interrupted", file=sys.stderr)
            else:  # the last line: the root cause, not Ray's "RayTaskError(ValueError): ray::PolicyWorker.setup() ..."
                print(f"nrl: run {layout.run_id} failed: {describe_error(exc)}", file=sys.stderr)
            if signals.received == signal.SIGTERM:
                return EXIT_SIGTERM
            if signals.received == signal.SIGINT or isinstance(exc, KeyboardInterrupt):
                return EXIT_SIGINT
            return EXIT_FAILED
    if summary:
        print_summary(result, time.perf_counter() - t0)
    return 0


def run_pipeline_flow(call: Callable[[], dict[str, Any]], layout: Any) -> int:
    """Run a pipeline flow as :func:`run_flow` runs a run's: exit 0 when every stage is done,
    :data:`EXIT_GATED` when a gate stopped it (its message printed), else as :func:`run_flow`."""
    out: dict[str, Any] = {}

    def call_and_keep() -> dict[str, Any]:
        out.update(call())
        return out

    t0 = time.perf_counter()
    rc = run_flow(call_and_keep, layout, summary=False)
    if rc:
        return rc
    print(f"nrl: {out.get('message')} ({time.perf_counter() - t0:.0f} s)", flush=True)
    for name, stage in (out.get("stages") or {}).items():
        where = stage.get("final_checkpoint") or stage.get("checkpoint")
        gate = stage.get("gate")
        held = "" if not gate else f"  gate {gate['rule']}: {gate['value']} ({'held' if gate['held'] else 'not held'})"
        figures = stage.get("figures") or {}
        held += "".join(f"  {k} {figures[k]:.3f}" for k in ("accuracy", "pass_at_k") if isinstance(figures.get(k), (int, float)))
        print(f"nrl:   {name:10} {stage.get('kind', ''):5} {stage.get('run_id', '')}  {stage.get('outcome') or ''} {where or ''}{held}")
    return EXIT_GATED if out.get("status") == "gated" else 0


def print_summary(result: dict, seconds: float) -> None:
    """The finished run: steps, last metrics, where its metrics, steps and checkpoints are."""
    print(f"nrl: run {result['run_id']} finished {result['last_step']} steps in {seconds:.0f} s", flush=True)
    if result.get("final_line"):  # the last step's line, as its algorithm writes it
        print(f"nrl:   last step    {result['final_line']}")
    print(f"nrl:   metrics      {result['metrics_uri']}")
    print(f"nrl:   steps        {result['run_uri']}/steps/")
    for c in result.get("checkpoints", [])[-3:]:
        print(f"nrl:   checkpoint   {c}")
    print("nrl:   artifacts    Prefect UI (table/progress/markdown artifacts keyed "
          f"nrl-{result['run_id'].lower()}-*; `prefect artifact ls`)")
