"""``python -m benchmarks.bench_actor --quick`` end to end (tiny model): a plain child process and the
Ray-hosted Policy each train, interleaved, and the table says what each runs under. A subprocess, since
the benchmark starts (and shuts down) its own local Ray. No timing assertions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # its own local Ray and two model copies: ~30 s
def test_quick_run_times_both_sides_and_says_what_they_run_under():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_actor", "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    for name in ("plain process", "actor, from the caller", "actor, inside"):
        cells = [c.strip() for c in rows[name].split("|")[2:-1]]
        assert float(cells[0]) > 0 and cells[3].endswith("x"), rows[name]
    assert rows["nice"].split("|")[2].strip() == "0" and rows["nice"].split("|")[3].strip() == "0"  # not Ray's 15
    assert "False" in rows["main_thread"]  # the actor's call runs on a Ray thread
