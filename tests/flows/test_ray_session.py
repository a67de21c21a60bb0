"""Runtime helpers that need no Ray: waiting for the project's Ray-calling background threads
before a local Ray is shut down (a Ray call after ``ray.shutdown()`` ends the whole process)."""

from __future__ import annotations

import threading

from flows.run.ray_session import RAY_THREAD_PREFIXES, _ray_threads_finished


def _thread(name: str, hold: threading.Event) -> threading.Thread:
    th = threading.Thread(target=hold.wait, args=(30,), name=name, daemon=True)
    th.start()
    return th


def test_waits_for_fault_and_refit_threads_only():
    assert RAY_THREAD_PREFIXES == ("nrl-fault", "nrl-refit")
    hold, other = threading.Event(), threading.Event()
    fault = _thread("nrl-fault", hold)
    unrelated = _thread("nrl-artifacts_0", other)  # the artifact publisher never calls Ray
    try:
        assert _ray_threads_finished(0.2) is False and fault.is_alive()  # still busy: not waited out
        threading.Timer(0.2, hold.set).start()
        assert _ray_threads_finished(10.0) is True and not fault.is_alive()
        assert unrelated.is_alive()
    finally:
        hold.set()
        other.set()
