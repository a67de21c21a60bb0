"""Known answers of the multi-seed statistics (``benchmarks/_seed_stats.py``) and a smoke test of
its plots (``benchmarks/_seed_plots.py``): pure Python and numpy, seconds."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from benchmarks._seed_plots import write_plots
from benchmarks._seed_stats import (
    accuracy_per_second,
    bootstrap_diff_interval,
    decide,
    distribution,
    mann_whitney_u,
    markdown_report,
    min_detectable_difference,
    permutation_test_mean,
    read_rows,
)


def test_mann_whitney_exact_separated_groups():
    u, p = mann_whitney_u([1, 2, 3], [4, 5, 6])
    # U = 0 is 1 of the C(6, 3) = 20 orderings; two-sided: 2 / 20
    assert u == 0.0
    assert p == pytest.approx(0.1)
    assert mann_whitney_u([4, 5, 6], [1, 2, 3]) == (9.0, pytest.approx(0.1))


def test_mann_whitney_ties_normal_approximation():
    a, b = [1, 2, 2, 3], [2, 3, 4, 5]
    u, p = mann_whitney_u(a, b)
    # U: a=1 beats none; each a=2 ties the b=2 (0.5 each, 1.0); a=3 beats b=2 and ties b=3 (1.5): U = 2.5.
    # mu = 4*4/2 = 8; N = 8; tie groups: value 2 three times (27-3 = 24), value 3 twice (8-2 = 6), sum 30;
    # sigma^2 = 4*4/12 * (N + 1 - 30/(N(N-1))) = 4/3 * (9 - 30/56) = 11.2857..., sigma = 3.3594;
    # z = (|2.5 - 8| - 0.5) / 3.3594 = 1.4884; p = 2 * (1 - Phi(1.4884)) = 0.1367
    sigma = math.sqrt(16 / 12 * (9 - 30 / 56))
    assert u == 2.5
    assert p == pytest.approx(2 * (1 - statistics.NormalDist().cdf(5.0 / sigma)))
    assert p == pytest.approx(0.1367, abs=5e-4)


def test_mann_whitney_symmetry():
    a, b = [0.1, 0.4, 0.4, 0.9, 0.3], [0.4, 0.2, 0.8]
    (u_ab, p_ab), (u_ba, p_ba) = mann_whitney_u(a, b), mann_whitney_u(b, a)
    assert u_ab + u_ba == len(a) * len(b)
    assert p_ab == pytest.approx(p_ba)
    assert mann_whitney_u([0.5] * 4, [0.5] * 3) == (6.0, 1.0)


def test_permutation_test_known_answers():
    assert permutation_test_mean([0.3, 0.5, 0.7], [0.3, 0.5, 0.7]) == 1.0
    # C(8, 4) = 70 splits; only the observed one and its mirror reach |diff| = 1
    assert permutation_test_mean([0, 0, 0, 0], [1, 1, 1, 1]) == pytest.approx(2 / 70)
    # Monte Carlo (C(40, 20) splits): (k + 1) / (n + 1), deterministic given the seed
    a, b = [0.0] * 20, [1.0] * 20
    assert permutation_test_mean(a, b, n_perm=2000, seed=1) == pytest.approx(1 / 2001)
    x, y = [0.1 * i for i in range(20)], [0.1 * i + 0.3 for i in range(20)]
    assert permutation_test_mean(x, y, n_perm=2000, seed=3) == permutation_test_mean(x, y, n_perm=2000, seed=3)


def test_bootstrap_intervals():
    a, b = [0.2, 0.5, 0.4, 0.7, 0.6], [0.1, 0.3, 0.2, 0.4]
    d = distribution(a, [0.0] * 5, n_boot=2000, seed=5)
    assert d.mean == pytest.approx(0.48) and d.ci_low <= d.mean <= d.ci_high
    assert d == distribution(a, [0.0] * 5, n_boot=2000, seed=5)
    lo, hi = bootstrap_diff_interval(a, b, n_boot=2000, seed=5)
    assert lo <= 0.48 - 0.25 <= hi
    assert (lo, hi) == bootstrap_diff_interval(a, b, n_boot=2000, seed=5)
    assert bootstrap_diff_interval([0.4] * 3, [0.1] * 3) == pytest.approx((0.3, 0.3))
    const = distribution([0.25] * 4, [0.0] * 4)
    assert (const.ci_low, const.mean, const.median, const.ci_high) == (0.25, 0.25, 0.25, 0.25)


def test_min_detectable_difference():
    a, b = [0.1, 0.2, 0.3, 0.4], [0.2, 0.4, 0.6]
    se = math.sqrt(statistics.variance(a) / 4 + statistics.variance(b) / 3)  # 0.0166.../4 + 0.04/3
    assert min_detectable_difference(a, b) == pytest.approx((1.959964 + 0.841621) * se, rel=1e-6)


def _row(system, seed, before, after, *, budget="tiny", step_s=0.5, steps=4):
    times = [0.0, 2.0 * step_s * steps / 2, 2.0 * step_s * steps]
    accs = [before, (before + after) / 2, after]
    return {"system": system, "budget": budget, "seed": seed, "steps": steps, "val": 20, "acc_before": before,
            "acc_after": after, "median_step_s": step_s, "rewards": [before + (after - before) * i / steps for i in range(steps)],
            "curve": [{"step": 2 * i, "train_s": t, "acc": a} for i, (t, a) in enumerate(zip(times, accs))]}


def test_decide_verdicts_and_rise_fraction():
    high = [_row("nrl", s, 0.3, 0.6 + 0.05 * (s % 3)) for s in range(10)]
    low = [_row("trl", s, 0.3, 0.3 + 0.05 * (s % 3)) for s in range(10)]
    d = decide(high + low, "tiny")
    assert d.verdict.startswith("ours higher: ") and d.p_mwu < 0.05 and d.diff_low > 0
    assert decide([{**r, "system": "trl" if r["system"] == "nrl" else "nrl"} for r in high + low],
                  "tiny").verdict.startswith("ours lower: ")
    same = [_row(sys, s, 0.3, 0.4 + 0.05 * (s % 4)) for sys in ("nrl", "trl") for s in range(8)]
    d = decide(same, "tiny")
    assert d.verdict.startswith("no difference found: ") and d.p_mwu == pytest.approx(1.0)
    assert "at these 8 vs 8 seeds" in d.verdict and d.mdd > 0
    # a rise of exactly 0.1 counts: 0.4 - 0.3 is 0.10000000000000003 in float, 0.3 - 0.2 is 0.09999999999999998
    # (counted through the 1e-9 tolerance); 0.59 - 0.5 is not
    d = decide([_row("nrl", 0, 0.3, 0.4), _row("nrl", 1, 0.7, 0.8), _row("nrl", 2, 0.5, 0.59),
                _row("trl", 0, 0.3, 0.35), _row("trl", 1, 0.2, 0.3)], "tiny")
    assert d.ours.frac_rise == pytest.approx(2 / 3) and d.theirs.frac_rise == pytest.approx(1 / 2)


def test_wall_clock_and_report():
    rows = [_row("nrl", s, 0.2, 0.6, step_s=0.5) for s in range(3)] + [_row("trl", s, 0.2, 0.4, step_s=1.0) for s in range(3)]
    nrl, trl = accuracy_per_second(rows, "tiny")
    # target 0.4 (trl's mean final): nrl's curve is at 0.4 at its middle point (2 s), trl's at its last (8 s)
    assert (nrl.target, nrl.reached, nrl.median_s, trl.reached, trl.median_s) == (pytest.approx(0.4), 3, 2.0, 3, 8.0)
    assert nrl.acc_per_s == pytest.approx(0.4 / 4.0) and trl.acc_per_s == pytest.approx(0.2 / 8.0)
    text = markdown_report(rows, "tiny")
    assert "| 0 | 0.200 -> 0.600 | 0.200 -> 0.400 | 0.50 | 1.00 |" in text
    assert "Verdict: " in text and "<" not in text.replace("p<0.001", "")


def test_read_rows(tmp_path):
    path = tmp_path / "seeds.jsonl"
    first, second = _row("nrl", 0, 0.1, 0.2), _row("nrl", 0, 0.1, 0.5)
    path.write_text("\n".join(json.dumps(r) for r in (first, _row("trl", 0, 0.1, 0.3), second)) + "\n\n")
    rows = read_rows(str(path))
    assert [(r["system"], r["acc_after"]) for r in rows] == [("trl", 0.3), ("nrl", 0.5)]
    path.write_text(json.dumps(first) + "\n\n{not json\n")
    with pytest.raises(ValueError, match="line 3"):
        read_rows(str(path))


def test_plots_written(tmp_path):
    rows = [_row(sys, s, 0.2 + 0.05 * s, 0.5 + 0.1 * s, steps=30) for sys in ("nrl", "trl") for s in range(3)]
    paths = write_plots(rows, "tiny", str(tmp_path / "plots"))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["bench_vs_trl_tiny_reward.png", "bench_vs_trl_tiny_acc_vs_time.png"]
    for p in paths:
        data = Path(p).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) < 20_000
    assert sorted(f.name for f in (tmp_path / "plots").iterdir()) == sorted(p.rsplit("/", 1)[1] for p in paths)
