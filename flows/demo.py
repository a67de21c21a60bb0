"""``make demo``: GRPO that visibly learns, on 2 CPU cores, in a few minutes.

1. prepares the tiny built-in model (made locally, nothing downloaded);
2. ``nrl grpo --config configs/grpo_tiny_demo.yaml``: the GRPO flow first runs the config's
   short SFT warm start (``warm_start.sft_steps``, :mod:`flows.algorithms.warm_start`) so the model knows the
   answer format and is right some of the time (single-digit addition, exact-match reward), then
   GRPO from those weights: the mean reward rises over the steps;
3. prints the reward curve and where the metrics, artifacts and checkpoints are.

The real pretrained SmolLM2-135M-Instruct config (``configs/grpo_smollm2.yaml``) is too slow for a
10-minute budget on 2 cores (see README for its measured step time); this demo is the fast path.

    python -m flows.demo [--storage ./runs] [--sft-steps 60] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from flows.cli import _quiet_env
from flows.cli import main as nrl
from flows.config import load_config
from flows.observe.metrics import read_metrics
from flows.run.state import normalize_root
from nrl_tasks.models.builtin import resolve_model_path
from nrl_tasks.run_layout import RunLayout

_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEMO_CONFIG = os.path.join(_CONFIGS, "grpo_tiny_demo.yaml")
SMOLLM2_CONFIG = os.path.join(_CONFIGS, "grpo_smollm2.yaml")


def _env() -> None:
    _quiet_env()  # the same quiet, offline defaults as the `nrl` CLI
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--storage", default="./runs")
    ap.add_argument("--config", default=DEMO_CONFIG)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--run-id", default=None)
    ap.add_argument(
        "--smollm2", action="store_true",
        help="GRPO on the real SmolLM2-135M-Instruct (configs/grpo_smollm2.yaml, no SFT); ~1 min per step on 2 cores",
    )
    ap.add_argument("overrides", nargs="*", help="GRPO config overrides")
    args = ap.parse_args(argv)
    _env()
    t0 = time.perf_counter()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_id = args.run_id or f"demo-{stamp}"

    if args.smollm2:
        config = SMOLLM2_CONFIG if args.config == DEMO_CONFIG else args.config
        cfg = load_config(config, args.overrides)
        print(f"[demo] 1/2 model: {cfg.policy.model_name} -> {resolve_model_path(cfg.policy.model_name)}", flush=True)
        print(f"[demo] 2/2 nrl grpo --config {os.path.relpath(config)} ({cfg.grpo.max_num_steps} steps)", flush=True)
        rc = nrl(["grpo", "--config", config, "--storage", args.storage, "--run-id", run_id, *args.overrides])
        return rc if rc != 0 else _report(args, run_id, t0)
    overrides = [f"warm_start.sft_steps={args.sft_steps}", f"warm_start.lr={args.sft_lr}", *args.overrides]
    cfg = load_config(args.config, overrides)
    print(f"[demo] 1/2 model: {cfg.policy.model_name} -> {resolve_model_path(cfg.policy.model_name)}", flush=True)
    print(f"[demo] 2/2 nrl grpo --config {os.path.relpath(args.config)}: first an SFT warm start of "
          f"{args.sft_steps} steps (run {run_id}-sft), then {cfg.grpo.max_num_steps} GRPO steps from its weights", flush=True)
    rc = nrl(["grpo", "--config", args.config, "--storage", args.storage, "--run-id", run_id, *overrides])
    if rc != 0:
        return rc
    return _report(args, run_id, t0)


def _report(args: argparse.Namespace, run_id: str, t0: float) -> int:
    layout = RunLayout(normalize_root(args.storage), run_id)
    rows = read_metrics(layout.metrics_uri)
    rewards = [r.get("reward_mean") or 0.0 for r in rows]
    print("\n[demo] reward curve (mean reward per step):")
    for r in rows:
        bar = "#" * int(round(40 * (r.get("reward_mean") or 0.0)))
        print(f"  step {r['step']:3d}  {r.get('reward_mean') or 0.0:5.3f}  {bar}")
    k = max(1, min(3, len(rewards) // 2))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(f"\n[demo] mean reward, first {k} steps: {first:.3f}; last {k} steps: {last:.3f} ({'rising' if last > first else 'NOT rising'})")
    print(f"[demo] total time {time.perf_counter() - t0:.0f} s")
    print(f"[demo] metrics:     {layout.metrics_uri}")
    print(f"[demo] batches:     {layout.steps_uri}/step_*/{{prompts,rollouts,rewards,logprobs,advantages,train}} (Arrow)")
    print(f"[demo] checkpoints: {layout.checkpoints_uri}/step_*/weights (HF safetensors)")
    print(f"[demo] artifacts:   Prefect table/progress/markdown artifacts keyed nrl-{run_id.lower()}-*")
    print("[demo]              (a local UI: `prefect server start`, then rerun with PREFECT_API_URL set; see README)")
    print(f"[demo] evaluate checkpoints: nrl eval {run_id} --storage {args.storage}")
    return 0 if last > first else 1


if __name__ == "__main__":
    sys.exit(main())
