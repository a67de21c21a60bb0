"""Session-wide test environment: isolated Prefect home, one local Ray per session.

Shared fixtures live in ``tests/fixtures/*`` and are registered below so every test
package (mirroring the source layout) can use them.
"""

from __future__ import annotations

import os
import tempfile

# Must be set before prefect or ray are imported anywhere in the test session.
_SESSION_TMP = tempfile.mkdtemp(prefix="nrl-tests-")
os.environ.setdefault("PREFECT_HOME", os.path.join(_SESSION_TMP, "prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.pop("RAY_ADDRESS", None)
# The fault suites' plug-in (inert unless a fault variable is set), for this process and every flow
# process the tests start (CLI, Prefect workers): they find the tests package on PYTHONPATH.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["NRL_PLUGINS"] = "tests.faults.injection"
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p)

pytest_plugins = [
    "tests.fixtures.ray_env",
    "tests.fixtures.s3",
    "tests.fixtures.models",
    "tests.fixtures.grpo_runs",
    "tests.fixtures.scheduling",
]


def session_tmp() -> str:
    """A per-session scratch directory (removed with the OS temp dir)."""
    return _SESSION_TMP
