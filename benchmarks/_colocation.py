"""Colocated vs separate generation, whole GRPO jobs side by side (part of ``bench_sharding``).

Two ``grpo`` flow runs of the same config, seeds and steps, each on its own local Ray started by
the flow: ``separate`` (a generation worker actor beside the policy worker, weights refitted over
the packed broadcast after every step) and ``colocated`` (``generation.colocated.enabled=true``:
the policy worker samples on its live weights; the refit records the version only).

Figures per run: ``peak job PSS MB``: the largest sum, over one sample, of the proportional set
size of this process and every process below it (the flow, its local Ray's daemons and the
actors; PSS shares a page among the processes that map it, so the sum does not count a shared
library twice), sampled every 0.5 s while the run is up; ``actors``: the same sum over the Ray
actor processes only (``ray::...``), the part colocation changes; ``step s``: median of the
metrics lines' ``step_s`` after the first step, and ``generate``/``refit`` medians. The two runs
sample the same tokens (same weights, seeds and sampling call), which the rewards column shows.
"""

from __future__ import annotations

import os
import statistics
import threading
from typing import Any

__all__ = ["TreeMemory", "colocation_rows", "print_colocation"]

VARIANTS = {"separate": [], "colocated": ["generation.colocated.enabled=true"]}


class TreeMemory:
    """Peak summed PSS of this process and its descendants, sampled by a daemon thread."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.peak_total_mb = 0.0
        self.peak_actors_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> tuple[float, float]:
        import psutil

        me = psutil.Process()
        total = actors = 0.0
        for proc in [me, *me.children(recursive=True)]:
            try:
                pss = proc.memory_full_info().pss / 1e6
                argv = proc.cmdline()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            total += pss
            if argv and argv[0].startswith("ray::"):
                actors += pss
        return total, actors

    def _run(self) -> None:
        while not self._stop.is_set():
            total, actors = self._sample()
            self.peak_total_mb = max(self.peak_total_mb, total)
            self.peak_actors_mb = max(self.peak_actors_mb, actors)
            self._stop.wait(self.period_s)


def _median_after_first(rows: list[dict[str, Any]], key: str) -> float:
    values = [float(r.get(key) or 0.0) for r in rows[1:]] or [float(rows[0].get(key) or 0.0)]
    return statistics.median(values)


def colocation_rows(config: str, overrides: list[str], steps: int, tmp: str) -> dict[str, dict[str, Any]]:
    """One flow run per variant (``separate``, ``colocated``); their figures."""
    from flows.config import load_config
    from flows.algorithms.grpo import grpo
    from flows.observe.metrics import read_metrics

    out: dict[str, dict[str, Any]] = {}
    for name, extra in VARIANTS.items():
        root = os.path.join(tmp, f"colocation-{name}")
        cfg = load_config(config, [
            *overrides, *extra, f"grpo.max_num_steps={steps}", "grpo.val_period=0", "checkpointing.enabled=false",
            "logger.console=false", f"storage.root={root}", "cluster.ray.address=null",
        ])
        with TreeMemory() as mem:
            res = grpo(config=cfg, run_id=f"bench-colocation-{name}")
        rows = read_metrics(res["metrics_uri"])
        out[name] = {
            "peak_job_mb": mem.peak_total_mb, "peak_actors_mb": mem.peak_actors_mb,
            "step_s": _median_after_first(rows, "step_s"), "generate_s": _median_after_first(rows, "generate_s"),
            "refit_s": _median_after_first(rows, "refit_s"), "rewards": [r.get("reward_mean") for r in rows],
        }
        print(f"[{name}] peak job PSS {mem.peak_total_mb:.0f} MB (actors {mem.peak_actors_mb:.0f}), "
              f"step {out[name]['step_s']:.2f} s", flush=True)
    return out


def print_colocation(label: str, rows: dict[str, dict[str, Any]], steps: int) -> None:
    base = rows["separate"]
    print(f"### colocated vs separate generation: {label}; {steps} GRPO steps each, 1 policy rank; "
          "step s = median after the first step")
    print("| generation | peak job PSS MB | vs separate | actors PSS MB | vs separate | step s | speed vs separate "
          "| generate s | refit s | reward per step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, r in rows.items():
        rewards = " ".join(f"{x:.3f}" for x in r["rewards"])
        print(f"| {name} | {r['peak_job_mb']:.0f} | {r['peak_job_mb'] / base['peak_job_mb']:.2f}x "
              f"| {r['peak_actors_mb']:.0f} | {r['peak_actors_mb'] / base['peak_actors_mb']:.2f}x | {r['step_s']:.2f} "
              f"| {base['step_s'] / r['step_s']:.2f}x | {r['generate_s']:.2f} | {r['refit_s']:.3f} | {rewards} |")
