"""Many seeds of two systems turned into a decision: the statistics of ``bench_vs_trl_seeds.jsonl``.

Each line of the file is one seed of one system on one budget (``benchmarks/bench_vs_trl.py``): the
held-out greedy accuracy before and after training, the training reward per step and the accuracy
curve against cumulative training seconds. The figures here:

- per system, the distribution of the final accuracy (:func:`distribution`): mean, median, a 95%
  percentile bootstrap interval of the mean, and the fraction of seeds whose accuracy rose by at
  least 0.1 (compared with a 1e-9 tolerance, so 0.3 -> 0.4 counts despite float rounding);
- ours against theirs: the Mann-Whitney U test (:func:`mann_whitney_u`, the decision), a
  permutation test on the difference of means (:func:`permutation_test_mean`, a check), a 95%
  bootstrap interval of that difference (:func:`bootstrap_diff_interval`) and the smallest
  difference the comparison could detect at these seed counts (:func:`min_detectable_difference`);
- the wall clock (:func:`accuracy_per_second`): training seconds to reach a common accuracy.

Assumptions. Seeds are independent draws, and the two systems are compared as two independent
samples (not paired by seed: the same seed drives different random streams in TRL and in ours).
Accuracies are bounded in [0, 1] and are multiples of 1/val, so equal values (ties) are common:
Mann-Whitney is exact (the null distribution of U counted by dynamic programming) only when there
are no ties and each group has at most 20 seeds, otherwise it uses the normal approximation with
the tie correction of the variance and a continuity correction of 0.5. The bootstrap intervals are
percentile intervals (they never leave [0, 1], and are too narrow for a handful of seeds). The
detectable difference uses the normal approximation with the observed Welch standard error; it is
a guide to what "no difference found" can mean, not a guarantee.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Decision", "Distribution", "WallClock", "accuracy_per_second", "bootstrap_diff_interval", "decide",
           "distribution", "mann_whitney_u", "markdown_report", "mean_band", "min_detectable_difference",
           "permutation_test_mean", "read_rows"]

Row = dict[str, Any]
_EPS = 1e-9  # tolerance of the comparisons of accuracies (multiples of 1/val, rounded in float)
_EXACT_MAX = 20  # exact Mann-Whitney up to this many seeds per group (and no ties)


def read_rows(path: str) -> list[Row]:
    """The rows of a seeds JSONL file; for a (system, budget, seed) seen twice, the last one."""
    rows: dict[tuple[Any, Any, Any], Row] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                key = (row["system"], row["budget"], row["seed"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}, line {number}: not a seed row ({e})") from e
            rows.pop(key, None)  # the last one wins, in the place it was written
            rows[key] = row
    return list(rows.values())


@dataclass(frozen=True)
class Distribution:
    """The final accuracy of one system over its seeds."""

    n: int
    mean: float
    median: float
    ci_low: float  # 95% percentile bootstrap interval of the mean
    ci_high: float
    frac_rise: float  # fraction of seeds with after - before >= rise


def mean_band(values: np.ndarray, *, n_boot: int = 10_000, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per column of ``values`` (rows: seeds): the mean and its 95% percentile bootstrap interval,
    resampling whole rows (seeds)."""
    values = np.asarray(values, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(values), size=(n_boot, len(values)))
    means = values[idx].mean(axis=1)
    return values.mean(axis=0), np.percentile(means, 2.5, axis=0), np.percentile(means, 97.5, axis=0)


def distribution(after: Sequence[float], before: Sequence[float], *, rise: float = 0.1, n_boot: int = 10_000,
                 seed: int = 0) -> Distribution:
    """The :class:`Distribution` of ``after`` (one per seed; ``before``: the same seeds' starts)."""
    a, b = np.asarray(after, dtype=float), np.asarray(before, dtype=float)
    if len(a) == 0 or len(a) != len(b):
        raise ValueError(f"need as many starts as ends, at least one: {len(a)} vs {len(b)}")
    mean, lo, hi = mean_band(a[:, None], n_boot=n_boot, seed=seed)
    return Distribution(len(a), float(mean[0]), float(np.median(a)), float(lo[0]), float(hi[0]),
                        float(np.mean(a - b >= rise - _EPS)))


def _u_counts(m: int, n: int) -> list[int]:
    """How many of the C(m+n, m) orderings of m a's and n b's give U = 0, 1, ..., m*n (no ties):
    f(i, j) = f(i-1, j) shifted by j (the largest is an a, above all j b's) + f(i, j-1)."""
    prev = [[1] for _ in range(n + 1)]  # f(0, j)
    for _ in range(m):
        cur = [[1]]
        for j in range(1, n + 1):
            top, left = [0] * j + prev[j], cur[j - 1]
            cur.append([x + (left[k] if k < len(left) else 0) for k, x in enumerate(top)])
        prev = cur
    return prev[n]


def mann_whitney_u(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """U of ``a`` (pairs with a_i > b_j, plus half the ties) and its two-sided p: exact when there
    are no ties and both groups have at most 20 values, else normal with tie and continuity
    corrections (module docstring)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    m, n = len(x), len(y)
    if not m or not n:
        raise ValueError("both groups need at least one value")
    u = float(np.sum(x[:, None] > y[None, :]) + 0.5 * np.sum(x[:, None] == y[None, :]))
    _, tie_sizes = np.unique(np.concatenate([x, y]), return_counts=True)
    if tie_sizes.max() == 1 and max(m, n) <= _EXACT_MAX:
        counts = _u_counts(m, n)
        low = int(min(u, m * n - u))  # the distribution is symmetric about m*n/2
        return u, min(1.0, 2 * sum(counts[:low + 1]) / math.comb(m + n, m))
    big_n = m + n
    var = m * n / 12 * ((big_n + 1) - float(np.sum(tie_sizes ** 3 - tie_sizes)) / (big_n * (big_n - 1)))
    if var <= 0:  # every value equal
        return u, 1.0
    z = max(abs(u - m * n / 2) - 0.5, 0.0) / math.sqrt(var)
    return u, min(1.0, 2 * (1 - statistics.NormalDist().cdf(z)))


def permutation_test_mean(a: Sequence[float], b: Sequence[float], *, n_perm: int = 20_000, seed: int = 0) -> float:
    """Two-sided p of |mean(a) - mean(b)| under relabelling: every split when there are at most
    ``n_perm`` of them, else ``n_perm`` random ones with p = (k + 1) / (n_perm + 1)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not len(x) or not len(y):
        raise ValueError("both groups need at least one value")
    pool, m, total = np.concatenate([x, y]), len(x), float(np.sum(x) + np.sum(y))
    observed = abs(x.mean() - y.mean())

    def stat(sums: np.ndarray) -> np.ndarray:  # |difference of means| of splits, from the sums of their first group
        return np.abs(sums / m - (total - sums) / len(y))

    if math.comb(len(pool), m) <= n_perm:
        splits = np.array(list(itertools.combinations(range(len(pool)), m)))
        return float(np.mean(stat(pool[splits].sum(axis=1)) >= observed - _EPS))
    shuffled = np.random.default_rng(seed).permuted(np.tile(pool, (n_perm, 1)), axis=1)
    k = int(np.sum(stat(shuffled[:, :m].sum(axis=1)) >= observed - _EPS))
    return (k + 1) / (n_perm + 1)


def bootstrap_diff_interval(a: Sequence[float], b: Sequence[float], *, n_boot: int = 10_000,
                            seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of mean(a) - mean(b), each group resampled on its own."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    rng = np.random.default_rng(seed)
    diffs = x[rng.integers(0, len(x), (n_boot, len(x)))].mean(1) - y[rng.integers(0, len(y), (n_boot, len(y)))].mean(1)
    return float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))


def min_detectable_difference(a: Sequence[float], b: Sequence[float], *, alpha: float = 0.05,
                              power: float = 0.8) -> float:
    """(z_{1-alpha/2} + z_power) * sqrt(s_a^2/n_a + s_b^2/n_b), sample variances (n - 1)."""
    z = statistics.NormalDist()
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    return (z.inv_cdf(1 - alpha / 2) + z.inv_cdf(power)) * se


@dataclass(frozen=True)
class Decision:
    """Ours against theirs on one budget; ``diff``: mean(ours) - mean(theirs)."""

    budget: str
    ours: Distribution
    theirs: Distribution
    diff: float
    diff_low: float
    diff_high: float
    u: float
    p_mwu: float
    p_perm: float
    mdd: float
    verdict: str


def _finished(rows: Sequence[Row], budget: str, system: str) -> list[Row]:
    """The seeds of ``system`` on ``budget`` with both accuracies, by seed."""
    out = [r for r in rows if r["budget"] == budget and r["system"] == system
           and r.get("acc_before") is not None and r.get("acc_after") is not None]
    if not out:
        raise ValueError(f"no finished seeds of {system!r} on budget {budget!r}")
    return sorted(out, key=lambda r: r["seed"])


def _p(p: float) -> str:
    return "p<0.001" if p < 0.001 else f"p={p:.2g}"


def decide(rows: Sequence[Row], budget: str, *, ours: str = "nrl", theirs: str = "trl") -> Decision:
    """The statistics of ``budget`` and one sentence: higher, lower, or no difference found (at 0.05)."""
    mine, other = _finished(rows, budget, ours), _finished(rows, budget, theirs)
    a, b = [r["acc_after"] for r in mine], [r["acc_after"] for r in other]
    d_ours = distribution(a, [r["acc_before"] for r in mine])
    d_theirs = distribution(b, [r["acc_before"] for r in other])
    diff, (lo, hi) = d_ours.mean - d_theirs.mean, bootstrap_diff_interval(a, b)
    u, p_mwu = mann_whitney_u(a, b)
    mdd = min_detectable_difference(a, b) if len(a) > 1 and len(b) > 1 else float("nan")
    means = f"mean {d_ours.mean:.2f} vs {d_theirs.mean:.2f} ({diff:+.2f}, 95% interval {lo:+.2f}..{hi:+.2f})"
    if p_mwu < 0.05:
        word = "higher" if u > len(a) * len(b) / 2 else "lower"
        if (lo > 0) if word == "higher" else (hi < 0):
            verdict = f"ours {word}: {means}, Mann-Whitney {_p(p_mwu)}"
        else:
            verdict = (f"ours {word} by rank (Mann-Whitney {_p(p_mwu)}) but the bootstrap interval of the difference "
                       f"of means does not exclude 0: {means}")
    else:
        narrow = "yes" if -0.1 < lo and hi < 0.1 else "no"
        verdict = (f"no difference found: mean {d_ours.mean:.2f} vs {d_theirs.mean:.2f}, Mann-Whitney {_p(p_mwu)}; "
                   f"the test would detect a difference of {mdd:.2f} (80% power) at these {len(a)} vs {len(b)} seeds; "
                   f"the 95% interval of the difference is {lo:+.2f}..{hi:+.2f} (narrower than ±0.1: {narrow})")
    return Decision(budget, d_ours, d_theirs, diff, lo, hi, u, p_mwu, permutation_test_mean(a, b), mdd, verdict)


@dataclass(frozen=True)
class WallClock:
    """Training seconds of one system to reach ``target`` held-out accuracy, over its seeds."""

    system: str
    target: float  # the lower of the systems' mean final accuracies
    n: int
    reached: int  # seeds whose curve reaches the target
    mean_s: float  # over the seeds that reached it (nan: none did)
    median_s: float
    acc_per_s: float  # mean over seeds of (acc_after - acc_before) / final train_s


def accuracy_per_second(rows: Sequence[Row], budget: str, systems: Sequence[str] = ("nrl", "trl")) -> list[WallClock]:
    """Per system: the first cumulative training second at which each seed's curve reaches the
    common target (the lower mean final accuracy, so both systems can reach it), and the gain in
    accuracy per training second over the whole run."""
    by_system = {s: _finished(rows, budget, s) for s in systems}
    target = min(statistics.fmean(r["acc_after"] for r in rs) for rs in by_system.values())
    out = []
    for system, rs in by_system.items():
        times = [next((p["train_s"] for p in r.get("curve", []) if p["acc"] >= target - _EPS), None) for r in rs]
        hit = [t for t in times if t is not None]
        rates = [(r["acc_after"] - r["acc_before"]) / r["curve"][-1]["train_s"] for r in rs
                 if r.get("curve") and r["curve"][-1]["train_s"] > 0]
        nan = float("nan")
        out.append(WallClock(system, target, len(rs), len(hit), statistics.fmean(hit) if hit else nan,
                             statistics.median(hit) if hit else nan, statistics.fmean(rates) if rates else nan))
    return out


def _cells(r: Row | None) -> tuple[str, str]:
    """A seed's "before -> after" and median step seconds ("n/a": missing)."""
    r = r or {}
    acc = "n/a" if r.get("acc_before") is None or r.get("acc_after") is None else f"{r['acc_before']:.3f} -> {r['acc_after']:.3f}"
    return acc, "n/a" if r.get("median_step_s") is None else f"{r['median_step_s']:.2f}"


def markdown_report(rows: Sequence[Row], budget: str, *, ours: str = "nrl", theirs: str = "trl") -> str:
    """Per-seed table, the two distributions, the verdict and the wall-clock figures of ``budget``."""
    by_key = {(r["system"], r["seed"]): r for r in rows if r["budget"] == budget}
    seeds = sorted({seed for _, seed in by_key})
    lines = [f"### {budget}: {ours} vs {theirs}, {len(seeds)} seeds", "",
             f"| seed | {ours} before -> after | {theirs} before -> after | {ours} median step s | {theirs} median step s |",
             "|---:|---:|---:|---:|---:|"]
    for s in seeds:
        (o_acc, o_s), (t_acc, t_s) = _cells(by_key.get((ours, s))), _cells(by_key.get((theirs, s)))
        lines.append(f"| {s} | {o_acc} | {t_acc} | {o_s} | {t_s} |")
    d = decide(rows, budget, ours=ours, theirs=theirs)
    lines += ["", "| system | seeds | mean after | median after | 95% interval of the mean | rose by >= 0.1 |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, dist in ((ours, d.ours), (theirs, d.theirs)):
        lines.append(f"| {name} | {dist.n} | {dist.mean:.3f} | {dist.median:.3f} | {dist.ci_low:.3f}..{dist.ci_high:.3f} "
                     f"| {dist.frac_rise:.0%} |")
    lines += ["", f"Verdict: {d.verdict}. Permutation test on the mean: {_p(d.p_perm)}.", "",
              ("| system | target accuracy | seeds reaching it | median training s to it | mean training s to it "
               "| accuracy gain per training s |"), "|---|---:|---:|---:|---:|---:|"]
    for w in accuracy_per_second(rows, budget, (ours, theirs)):
        lines.append(f"| {w.system} | {w.target:.3f} | {w.reached}/{w.n} | {w.median_s:.1f} | {w.mean_s:.1f} "
                     f"| {w.acc_per_s:.4f} |")
    return "\n".join(lines) + "\n"
