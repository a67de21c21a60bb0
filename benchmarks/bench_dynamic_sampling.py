"""DAPO's dynamic sampling vs plain GRPO, side by side in one run.

    python -m benchmarks.bench_dynamic_sampling [--quick] [--steps N] [key=value ...]

Two GRPO runs through ``flows.algorithms.grpo.grpo`` on the same config and seed: the default (every
generated group is trained on, zero-variance groups included) and ``grpo.use_dynamic_sampling``
(groups whose rewards are all equal are dropped and more are generated until the batch is full).
Prints per run: the share of trained groups with reward variance (the ones that carry a gradient),
generation batches and rows generated per step, median step and generate seconds, and the
training reward. Default: SmolLM2-135M-Instruct on the built-in task (2-shot), 8 prompts x 4
samples; ``--quick``: the tiny model with a reward that is the parity of the response length.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Sequence
from typing import Any

from benchmarks._common import quiet_env

BASE = ["logger.step_subflows=false", "checkpointing.enabled=false", "grpo.val_period=0", "logger.console=false"]


def parity_reward(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """1 for an odd-length response: a reward a random tiny model gets half the time."""
    return [float(len(r) % 2) for r in responses]


def run(config: str, overrides: list[str], steps: int, tag: str, tmp: str) -> dict[str, Any]:
    import storage
    from flows.config import load_config
    from flows.algorithms.grpo import grpo
    from flows.observe.metrics import read_metrics

    root = os.path.join(tmp, tag)
    cfg = load_config(config, [*BASE, *overrides, f"grpo.max_num_steps={steps}", f"storage.root={root}"])
    res = grpo(config=cfg, run_id=f"bench-{tag}")
    rows = read_metrics(res["metrics_uri"])
    generated = []
    for r in rows:
        d = os.path.join(root, f"bench-{tag}", "steps", f"step_{int(r['step']):06d}")
        gb = os.path.join(d, "gen_batches")
        names = sorted(os.listdir(gb)) if os.path.isdir(gb) else []
        generated.append(sum(storage.read_manifest(os.path.join(gb, n, "rollouts")).rows for n in names)
                         if names else storage.read_manifest(os.path.join(d, "rollouts")).rows)
    later = rows[1:] or rows  # step 1 warms up
    med = lambda k: statistics.median(float(r.get(k) or 0.0) for r in later)  # noqa: E731
    groups = cfg.grpo.num_prompts_per_step
    return {
        "signal": sum(int(r.get("groups_with_signal") or 0) for r in rows) / (groups * len(rows)),
        "gen_batches": statistics.mean(float(r.get("dynamic_sampling_num_gen_batches") or 1) for r in rows),
        "generated": statistics.mean(generated), "trained": cfg.rollout_batch_size,
        "step_s": med("step_s"), "generate_s": med("generate_s"),
        "reward": [round(float(r.get("reward_mean") or 0.0), 3) for r in rows],
        "unfiltered": [round(float(r.get("unfiltered_reward_mean", r.get("reward_mean")) or 0.0), 3) for r in rows],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.quick:
        config, setting, steps = "configs/grpo_tiny.yaml", ["env.reward_fn=benchmarks.bench_dynamic_sampling:parity_reward"], 6
    else:
        config, setting, steps = "configs/grpo_smollm2.yaml", ["generation.max_new_tokens=16"], 4
    steps = args.steps or steps
    with tempfile.TemporaryDirectory(prefix="bench-ds-") as tmp:
        quiet_env(prefect_home=os.path.join(tmp, "prefect"))
        base = run(config, [*setting, *args.overrides], steps, "grpo", tmp)
        ds = run(config, [*setting, "grpo.use_dynamic_sampling=true", *args.overrides], steps, "dapo-ds", tmp)
    print(f"### dynamic sampling: {os.path.basename(config)}, {steps} steps (seconds: medians of steps 2..{steps})")
    print("| run | trained groups with reward variance | gen batches / step | rows generated / trained | step s | generate s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in (("GRPO (baseline)", base), ("dynamic sampling", ds)):
        print(f"| {name} | {r['signal']:.0%} | {r['gen_batches']:.2f} | {r['generated']:.0f} / {r['trained']} | "
              f"{r['step_s']:.2f} | {r['generate_s']:.2f} |")
    print(f"dynamic sampling / baseline: step time **{ds['step_s'] / max(base['step_s'], 1e-9):.2f}x**, "
          f"rows generated {ds['generated'] / base['generated']:.2f}x, groups with a gradient "
          f"{ds['signal']:.0%} vs {base['signal']:.0%}")
    print(f"reward_mean per step, baseline: {base['reward']}\nreward_mean per step (trained batch), dynamic sampling: "
          f"{ds['reward']}\nreward_mean per step (everything generated), dynamic sampling: {ds['unfiltered']}")
    return {"baseline": base, "dynamic_sampling": ds}


if __name__ == "__main__":
    main()
