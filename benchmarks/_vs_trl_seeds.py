"""The budgets of ``bench_vs_trl --budget`` and its results file: one JSON line per seed and system.

A budget fixes everything but the seed: the config, its overrides, the steps, the held-out prompts,
how often accuracy is measured (``val_every``, for the accuracy-against-time curve) and, for the tiny
model, the SFT warm start both systems load. The results file (:data:`RESULTS`, committed) gets one
line per finished seed and system, appended whole under an exclusive lock and fsynced: a benchmark
killed mid-seed loses that seed only, and the next ``--sweep`` starts at the first seed it lacks.
"""

from __future__ import annotations

import fcntl
import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

#: the committed results of the sweeps (one JSON line per seed and system)
RESULTS = "benchmarks/results/bench_vs_trl_seeds.jsonl"
#: the plots' folder (``benchmarks/plots/bench_vs_trl_<budget>_*.png``)
PLOTS = "benchmarks/plots"


@dataclass(frozen=True)
class Budget:
    """What one seed of one system runs on a budget."""

    config: str
    steps: int
    val: int
    val_every: int
    overrides: tuple[str, ...] = ()
    #: SFT warm start both systems load: ``(steps, lr)`` of ``run_sft_warm_start`` on ``config``
    warm_start: tuple[int, float] | None = None
    #: TRL's per-device micro-batch (None: ours); the update is the same, only its speed differs
    trl_micro_batch: int | None = None
    note: str = field(default="", compare=False)


BUDGETS: dict[str, Budget] = {
    "tiny": Budget(
        "configs/grpo_tiny_vs_trl.yaml", steps=60, val=64, val_every=10, warm_start=(60, 3e-3),
        note="tiny built-in model, single-digit addition (operands 0..5), 16 x 4 a step, 4 new tokens, T 0.5, "
             "lr 3e-4, from one 60-step SFT warm start"),
    "smollm2": Budget(
        "configs/grpo_smollm2_vs_trl.yaml", steps=25, val=200, val_every=5, trl_micro_batch=8,
        note="SmolLM2-135M-Instruct, single-digit products with the chat template, 8 x 4 a step, 16 new tokens, "
             "lr 5e-6 (grpo_smollm2_vs_trl.yaml)"),
    "smollm2_fewshot": Budget(
        "configs/grpo_smollm2_vs_trl.yaml", steps=25, val=200, val_every=5, trl_micro_batch=8,
        overrides=("data.chat_template=false", "data.arithmetic.few_shot=3", "data.arithmetic.max_operand=50",
                   "data.arithmetic.ops=[+,-]", "generation.max_new_tokens=8"),
        note="SmolLM2-135M-Instruct, addition and subtraction of operands 0..50 as a plain 3-shot completion "
             "(no chat template: the answer format is the shots'), 8 x 4 a step, 8 new tokens, lr 5e-6"),
}


def seed_line(system: str, budget: str, seed: int, b: Budget, run: dict[str, Any]) -> dict[str, Any]:
    """The results file's line of one finished run (``run``: ``run_trl`` / ``run_ours``'s figures)."""
    steady = run["step_s"][1:] or run["step_s"]
    load = os.getloadavg()
    return {
        "system": system, "budget": budget, "seed": seed, "steps": b.steps, "val": b.val,
        "acc_before": run["val_before"], "acc_after": run["val_after"],
        "median_step_s": round(statistics.median(steady), 4) if steady else None,
        "rewards": [round(float(r), 6) for r in run["rewards"]],
        "curve": [{"step": int(p["step"]), "train_s": round(float(p["train_s"]), 3), "acc": p["acc"]} for p in run["curve"]],
        "peak_mb": round(run["peak_mb"]), "wall_s": round(run["wall_s"], 1), "load_1m": round(load[0], 2),
        "commit": _commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def recorded(path: str) -> dict[tuple[str, str, int], dict[str, Any]]:
    """The lines of ``path`` by ``(system, budget, seed)`` (the last wins; none when the file is missing)."""
    if not os.path.exists(path):
        return {}
    from benchmarks._seed_stats import read_rows

    return {(r["system"], r["budget"], int(r["seed"])): r for r in read_rows(path)}


def append_line(path: str, line: dict[str, Any]) -> None:
    """Append ``line`` to ``path`` whole: one write under an exclusive lock, then fsync."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    data = (json.dumps(line, sort_keys=False) + "\n").encode()
    with open(path, "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


#: the keys that a rerun of a seed must reproduce (the outcome; times and memory vary)
OUTCOME_KEYS = ("acc_before", "acc_after", "rewards")


def same_outcome(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The outcome keys on which two lines of one seed differ (empty: it reproduced)."""
    diff = [k for k in OUTCOME_KEYS if a.get(k) != b.get(k)]
    if [p["acc"] for p in a.get("curve", [])] != [p["acc"] for p in b.get("curve", [])]:
        diff.append("curve")
    return diff
