"""``setup_runtime`` starts the actor groups at once (flows/run/runtime.py ``_start_together``)."""

from __future__ import annotations

import threading

import pytest

from flows.run.runtime import _start_together


def test_starts_overlap_all_end_and_the_first_error_is_raised():
    both_waiting = threading.Barrier(2, timeout=10)  # passes only if the two starts run at the same time
    ended = []

    def policy():
        both_waiting.wait()
        ended.append("policy")
        raise ValueError("policy failed")

    def generation():
        both_waiting.wait()
        ended.append("generation")

    with pytest.raises(ValueError, match="policy failed"):
        _start_together([policy, generation])
    assert sorted(ended) == ["generation", "policy"]  # the other start was not abandoned


def test_a_single_start_runs_in_the_callers_thread():
    seen = []
    _start_together([lambda: seen.append(threading.current_thread())])
    assert seen == [threading.current_thread()]
