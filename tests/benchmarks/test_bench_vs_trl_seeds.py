"""``bench_vs_trl --budget tiny`` end to end on two seeds (issue 44's smoke run): TRL's GRPOTrainer (its own
venv, ``.ci/trl_venv.sh``) and ``nrl grpo`` from one SFT warm start, 3 steps each. The sweep writes one line a
seed and system, a second sweep finds nothing left to run, a rerun of a seed reproduces its line, and the
decision and plots come out of the lines. No timing assertions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks._seed_stats import read_rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_two_tiny_seeds_of_both_systems_sweep_resume_and_reproduce(prefect_harness, tmp_path):
    results, plots = tmp_path / "seeds.jsonl", tmp_path / "plots"
    env = {**os.environ, "PREFECT_API_URL": prefect_harness}  # the session's server, not one per process

    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "benchmarks.bench_vs_trl", "--budget", "tiny", "--steps", "3", "--results",
               str(results), "--plots", str(plots), "--keep", str(tmp_path / "keep"), *args]
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=800, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done

    first = bench("--sweep", "2")
    rows = read_rows(str(results))
    assert sorted((r["system"], r["seed"]) for r in rows) == [("nrl", 0), ("nrl", 1), ("trl", 0), ("trl", 1)]
    for r in rows:
        assert len(r["rewards"]) == 3 and all(0.0 <= x <= 1.0 for x in r["rewards"])
        assert [p["step"] for p in r["curve"]] == [0, 3] and r["curve"][-1]["acc"] == r["acc_after"]
        assert r["curve"][0]["train_s"] == 0.0 < r["curve"][-1]["train_s"] and r["median_step_s"] > 0
    # one warm start, a seed's held-out prompts on both sides, each side's own greedy decoder: one accuracy before
    for seed in (0, 1):
        assert len({r["acc_before"] for r in rows if r["seed"] == seed}) == 1, [(r["system"], r["acc_before"]) for r in rows]
    assert "Mann-Whitney" in first.stdout or "p=" in first.stdout  # the decision was printed
    assert sorted(os.listdir(plots)) == ["bench_vs_trl_tiny_acc_vs_time.png", "bench_vs_trl_tiny_reward.png"]

    again = bench("--sweep", "2")  # nothing left to run: no new line
    assert "seed 0: nrl ..." not in again.stdout and len(results.read_text().splitlines()) == 4

    rerun = bench("--systems", "nrl", "--seeds", "1")  # deterministic: the same outcome as the recorded line
    assert "seed 1 nrl: reproduces the recorded line" in rerun.stdout, rerun.stdout[-2000:]
    assert len(results.read_text().splitlines()) == 4  # a rerun without --record writes nothing
