"""The run's background publisher (artifacts, tags, tracker sync off the step's critical path):
a bounded flush returns with what is still running kept pending, and close waits for it. A
subflow start waits on that flush (flows.algorithms.driver: ``before_subflow``), so a slow API
write delays a subflow by at most the flush's bound, and no publication is dropped."""

from __future__ import annotations

import threading

from flows.observe.artifacts import BackgroundPublisher


def test_a_bounded_flush_keeps_what_is_still_running_and_close_waits_for_it():
    pub = BackgroundPublisher()
    release, done = threading.Event(), []

    def slow(tag: str) -> None:
        release.wait(10)
        done.append(tag)

    pub.submit(slow, "a")
    pub.submit(done.append, "b")  # runs after "a": one worker, submission order
    pub.flush(timeout_s=0.2)
    assert done == []  # returned at its bound, before "a" could end
    release.set()
    pub.close(timeout_s=10)  # waits for both: the bounded flush kept them pending
    assert done == ["a", "b"]


def test_flush_after_the_backlog_is_done_returns_at_once_and_failures_are_not_raised():
    pub = BackgroundPublisher()
    pub.submit(lambda: 1 / 0)  # a failed publication is logged, never raised
    pub.flush(timeout_s=10)
    seen = []
    pub.submit(seen.append, 1)
    pub.flush(timeout_s=10)
    assert seen == [1]
    pub.close()
