"""Learning across seeds: SmolLM2-135M-Instruct on the built-in task, default vs a TRL-like preset.

    python -m benchmarks.bench_learning [--quick] [--seeds 0 1 2] [--steps 25] [key=value ...]

For each seed (``grpo.seed``: prompt order and sampling) and each preset, one GRPO run of
``--steps`` steps of 8 prompts x 4 samples on single-digit addition **without few-shot examples**
and with the exact-match (answer-only) reward; held-out greedy accuracy on the validation prompts
before training (``grpo.val_at_start``) and after the last step. Presets:

- ``default``: this project's defaults (leave-one-out baseline, std normalisation, token-level
  loss; the SmolLM2 config's AdamW lr 1e-5, no KL);
- ``trl-like``: group-mean advantage (no leave-one-out), std normalisation, token-level loss,
  weight decay 0, KL 0 (TRL GRPOTrainer's defaults as the issue describes them).

Prints one row per (preset, seed) with accuracy before and after, the training reward of the
first and last 5 steps, and per preset how many seeds rose and the mean accuracy after.
``--quick``: the tiny model, 2 seeds, 6 steps (a smoke run, not a learning result).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from benchmarks._common import quiet_env, val_accuracy

PRESETS = {
    "default": [],
    "trl-like": ["grpo.use_leave_one_out_baseline=false", "grpo.normalize_rewards=true", "loss_fn.token_level_loss=true",
                 "grpo.adv_estimator.std_epsilon=1e-4",
                 "policy.optimizer.kwargs.weight_decay=0.0", "loss_fn.reference_policy_kl_penalty=0.0"],
}


def run(config: str, overrides: list[str], steps: int, seed: int, tag: str, tmp: str) -> dict[str, Any]:
    from flows.config import load_config
    from flows.algorithms.grpo import grpo
    from flows.observe.metrics import read_metrics

    root = os.path.join(tmp, tag)
    cfg = load_config(config, [
        "data.arithmetic.few_shot=0", f"grpo.max_num_steps={steps}", "grpo.val_at_start=true", f"grpo.val_period={steps}",
        f"grpo.seed={seed}", "checkpointing.enabled=false", "logger.step_subflows=false", "logger.console=false",
        f"storage.root={root}", *overrides,
    ])
    run_id = f"learn-{tag}"
    res = grpo(config=cfg, run_id=run_id)
    rewards = [float(r.get("reward_mean") or 0.0) for r in read_metrics(res["metrics_uri"])]
    k = min(5, len(rewards))
    return {"before": val_accuracy(root, run_id, 0), "after": val_accuracy(root, run_id, steps),
            "reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, nargs="*", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    config = "configs/grpo_tiny.yaml" if args.quick else "configs/grpo_smollm2.yaml"
    seeds = args.seeds if args.seeds is not None else ([0, 1] if args.quick else [0, 1, 2])
    steps = args.steps or (6 if args.quick else 25)
    out: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        quiet_env(prefect_home=os.path.join(tmp, "prefect"))
        for preset, extra in PRESETS.items():
            out[preset] = [run(config, [*extra, *args.overrides], steps, s, f"{preset}-s{s}", tmp) for s in seeds]
    print(f"### learning across seeds: {os.path.basename(config)}, {steps} steps of 8 x 4, no few-shot, exact-match reward")
    print("| preset | seed | greedy accuracy before | after | train reward, first 5 steps | last 5 steps |")
    print("|---|---:|---:|---:|---:|---:|")
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    for preset, rows in out.items():
        for s, r in zip(seeds, rows):
            print(f"| {preset} | {s} | {fmt(r['before'])} | {fmt(r['after'])} | {r['reward_first']:.3f} | {r['reward_last']:.3f} |")
    for preset, rows in out.items():
        rose = sum(1 for r in rows if r["before"] is not None and r["after"] is not None and r["after"] > r["before"])
        after = [r["after"] for r in rows if r["after"] is not None]
        mean = sum(after) / len(after) if after else float("nan")
        print(f"{preset}: accuracy rose in {rose} of {len(rows)} seeds; mean accuracy after {mean:.3f} (goal: 3 of 3, >= 0.85)")
    return out


if __name__ == "__main__":
    main()
