"""Fixtures of the flow tests. ``prefect_harness`` and ``e2e_run`` (the session's uninterrupted
3-step reference run) live in ``tests/fixtures/grpo_runs.py``, shared with ``tests/faults``; the
helpers are re-exported here for the flow tests' imports."""

from __future__ import annotations

from tests.fixtures.grpo_runs import E2E_RUN_ID, REPO, TINY_CONFIG, kill_run_actors, tiny_run_config

__all__ = ["E2E_RUN_ID", "REPO", "TINY_CONFIG", "kill_run_actors", "tiny_run_config"]
