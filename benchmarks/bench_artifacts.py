"""What a run adds to Prefect's database per step, this tree vs another commit, in one run.

    python -m benchmarks.bench_artifacts [--quick] [--steps N] [--baseline-ref REF]

Runs ``nrl grpo`` on the tiny config (step subflows on, checkpoints every 10 steps, INFO logs, as a
user would) in a fresh process with its own Prefect home (the ephemeral API's SQLite database),
first on the code of ``--baseline-ref`` (a temporary git worktree; default ``f194e98``, before the
bounded artifacts and quiet logs) and then on this tree. While a run goes, this process watches
``metrics.jsonl`` and records the database's size (the ``.db`` file plus its write-ahead log) when
steps 10, 30 and ``N`` (default 90) are done. Prints bytes per step over steps 10-30 and 30-N:
constant growth per step means the two figures match; growth that grows with the run shows as
a larger second figure. ``--quick``: 10, 20 and 40 steps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _db_bytes(home: str) -> int:
    db = os.path.join(home, "prefect.db")
    return sum(os.path.getsize(p) for p in (db, db + "-wal") if os.path.exists(p))


def _lines(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as fh:
            return sum(1 for line in fh if line.strip())
    except FileNotFoundError:
        return 0


def run(tree: str, marks: tuple[int, ...], tmp: str, tag: str) -> dict[int, int]:
    """``{step: database bytes}`` of one ``nrl grpo`` run of ``max(marks)`` steps on the code in ``tree``."""
    home, root, run_id = os.path.join(tmp, f"prefect-{tag}"), os.path.join(tmp, f"runs-{tag}"), f"bench-{tag}"
    env = {**os.environ, "PREFECT_HOME": home, "PYTHONPATH": tree, "PREFECT_LOGGING_LEVEL": "INFO",
           "RAY_AUTH_MODE": "disabled", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "flows.cli", "grpo", "--config", os.path.join(REPO, "configs", "grpo_tiny.yaml"),
           "--run-id", run_id, "--storage", root, f"grpo.max_num_steps={max(marks)}", "checkpointing.save_period=10",
           "logger.console=false"]
    sizes: dict[int, int] = {}
    metrics = os.path.join(root, run_id, "metrics.jsonl")
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            done = _lines(metrics)
            for m in marks:
                if m not in sizes and done >= m:
                    sizes[m] = _db_bytes(home)
            time.sleep(0.1)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    out, err = proc.communicate(timeout=3600)
    stop.set()
    t.join()
    if proc.returncode != 0:
        raise RuntimeError(f"run {tag} failed (exit {proc.returncode}):\n{err[-3000:]}")
    return sizes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--baseline-ref", default="f194e98")
    args = ap.parse_args(argv)
    last = args.steps or (40 if args.quick else 90)
    marks = (10, 20 if args.quick else 30, last)
    out: dict[str, dict[int, int]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-artifacts-") as tmp:
        base_tree = os.path.join(tmp, "baseline")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-q", base_tree, args.baseline_ref], check=True)
        try:
            out["baseline"] = run(base_tree, marks, tmp, "baseline")
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", base_tree], check=False)
        out["this tree"] = run(REPO, marks, tmp, "this")
    a, b, c = marks
    print(f"### Prefect database growth per step: grpo_tiny.yaml, {c} steps, step subflows, INFO logs")
    print(f"| code | bytes/step, steps {a}-{b} | bytes/step, steps {b}-{c} | later / earlier | database at step {c} |")
    print("|---|---:|---:|---:|---:|")
    for name, s in (("baseline " + args.baseline_ref, out["baseline"]), ("this tree", out["this tree"])):
        early, late = (s[b] - s[a]) / (b - a), (s[c] - s[b]) / (c - b)
        print(f"| {name} | {early:,.0f} | {late:,.0f} | {late / max(early, 1):.2f} | {s[c] / 1e6:.1f} MB |")
    return out


if __name__ == "__main__":
    main()
