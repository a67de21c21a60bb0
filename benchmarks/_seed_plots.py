"""The two plots of a multi-seed ``bench_vs_trl`` budget, from the rows of ``bench_vs_trl_seeds.jsonl``.

- :func:`reward_band_png`: the mean training reward per step of each system (thick) and the 95%
  bootstrap interval of that mean over seeds (two thin lines of a lighter shade);
- :func:`accuracy_vs_time_png`: held-out greedy accuracy against cumulative training seconds: the
  mean accuracy at each validation point (the i-th point of every seed's curve, drawn at the mean of
  its ``train_s`` over seeds) as dots, with its 95% bootstrap interval over seeds.

The bands resample whole seeds (:func:`benchmarks._seed_stats.mean_band`), so they describe the mean
over seeds, not the spread of one seed. Seeds of one system with curves or reward lists of unequal
length are cut to the shortest. Drawn with :func:`flows.observe.plot.line_plot_png`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from benchmarks._seed_stats import Row, mean_band
from flows.observe.plot import BLUE, LIGHT_BLUE, Series, line_plot_png
from storage import write_bytes_atomic

__all__ = ["COLOURS", "accuracy_vs_time_png", "reward_band_png", "write_plots"]

Colour = tuple[int, int, int]
#: per system: (line colour, band colour)
COLOURS: dict[str, tuple[Colour, Colour]] = {"nrl": (BLUE, LIGHT_BLUE), "trl": ((255, 127, 14), (255, 187, 120))}
_N_BOOT = 2000


def _systems(rows: Sequence[Row], budget: str) -> dict[str, list[Row]]:
    by: dict[str, list[Row]] = {}
    for r in sorted(rows, key=lambda r: (r["system"], r["seed"])):
        if r["budget"] == budget:
            by.setdefault(r["system"], []).append(r)
    if not by:
        raise ValueError(f"no rows of budget {budget!r}")
    return by


def _colours(system: str, index: int) -> tuple[Colour, Colour]:
    return COLOURS.get(system, COLOURS["nrl" if index % 2 == 0 else "trl"])


def _band(label: str, xs: Sequence[float], lo: np.ndarray, hi: np.ndarray, colour: Colour) -> Series:
    """The lower and upper lines of a band as one series (one legend entry): a gap between them."""
    points = [*zip(xs, lo), (xs[-1], None), *zip(xs, hi)]
    return Series(label, [(float(x), None if y is None else float(y)) for x, y in points], colour, width=1)


def reward_band_png(rows: Sequence[Row], budget: str) -> bytes:
    """Mean training reward per step per system, with the 95% bootstrap band of the mean over seeds."""
    bands, means, last = [], [], 1
    for i, (system, rs) in enumerate(_systems(rows, budget).items()):
        steps = min(len(r["rewards"]) for r in rs)
        if steps == 0:
            continue
        line, light = _colours(system, i)
        mean, lo, hi = mean_band(np.array([r["rewards"][:steps] for r in rs], dtype=float), n_boot=_N_BOOT)
        xs = list(range(1, steps + 1))
        bands.append(_band(f"{system} 95% bootstrap", xs, lo, hi, light))
        means.append(Series(f"{system} mean (n={len(rs)})", list(zip(xs, mean.tolist())), line, width=3))
        last = max(last, steps)
    return line_plot_png(bands + means, x_label="step", y_label="training reward",
                         x_range=(1, max(last, 2)))


def accuracy_vs_time_png(rows: Sequence[Row], budget: str) -> bytes:
    """Mean held-out accuracy at each validation point against mean cumulative training seconds."""
    bands, means, right = [], [], 0.0
    for i, (system, rs) in enumerate(_systems(rows, budget).items()):
        points = min(len(r.get("curve", [])) for r in rs)
        if points == 0:
            continue
        line, light = _colours(system, i)
        acc = np.array([[p["acc"] for p in r["curve"][:points]] for r in rs], dtype=float)
        xs = np.array([[p["train_s"] for p in r["curve"][:points]] for r in rs], dtype=float).mean(axis=0).tolist()
        mean, lo, hi = mean_band(acc, n_boot=_N_BOOT)
        bands.append(_band(f"{system} 95% bootstrap", xs, lo, hi, light))
        means.append(Series(f"{system} mean (n={len(rs)})", list(zip(xs, mean.tolist())), line, dots=True))
        right = max(right, xs[-1])
    return line_plot_png(bands + means, x_label="training seconds (mean over seeds)",
                         y_label="held-out greedy accuracy", x_range=(0.0, right if right > 0 else 1.0))


def write_plots(rows: Sequence[Row], budget: str, out_dir: str) -> list[str]:
    """Write ``bench_vs_trl_<budget>_reward.png`` and ``..._acc_vs_time.png`` into ``out_dir``; their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, draw in (("reward", reward_band_png), ("acc_vs_time", accuracy_vs_time_png)):
        path = os.path.join(out_dir, f"bench_vs_trl_{budget}_{name}.png")
        write_bytes_atomic(path, draw(rows, budget))
        paths.append(path)
    return paths
