"""Sync vs async GRPO (age 1) through the flow, side by side in one run.

    python -m benchmarks.bench_async [--quick] [--steps N] [--no-smollm] [--no-learning] [key=value ...]

The same config and seed run twice through ``flows.algorithms.grpo.grpo`` on the same machine: synchronous,
and with ``grpo.async_grpo.enabled=true`` (``max_trajectory_age_steps=1``, importance-sampling
correction on, required). Prints per run: total wall, steps per second, processed tokens per
second (prompt + response tokens of every rollout, from the rollouts datasets; wall = the flow's
step loop, without Ray start and actor set-up), the summed
generation seconds (``generate`` + ``score``) and how much of it the async run hid behind the
policy's work (``(sync wall - async wall) / generation seconds``). Checkpoints and validation off.
Then, unless ``--no-smollm``, the same on SmolLM2-135M (8 prompts x 4 samples, 3 steps; minutes
per run on 2 cores; skipped with a note when its offline package is not installed), with the
config's 2 torch threads per actor and again with 1 (one core per lane).

**Learning** (unless ``--no-learning``): one SFT warm start of the tiny model
(``configs/grpo_tiny_demo.yaml``, as ``make demo``), then sync and async GRPO from it for the demo's
steps; the mean reward of the first 3 and the last 3 steps side by side.
``--quick`` (``make bench-quick``): the tiny comparison only.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from benchmarks._common import quiet_env, smollm2_available

ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]


def _tokens(root: str, run_id: str, steps: int) -> int:
    import storage

    total = 0
    for s in range(1, steps + 1):
        b = storage.load_batch(os.path.join(root, run_id, "steps", f"step_{s:06d}", "rollouts"), columns=["input_lengths"])
        total += int(b["input_lengths"].sum())
    return total


def run(config: str, overrides: list[str], steps: int, tag: str, tmp: str) -> dict[str, Any]:
    from flows.config import load_config
    from flows.algorithms.grpo import grpo
    from flows.observe.metrics import read_metrics

    root = os.path.join(tmp, tag)
    cfg = load_config(config, [*overrides, f"grpo.max_num_steps={steps}", "checkpointing.enabled=false",
                               "grpo.val_period=0", f"storage.root={root}", "logger.console=false"])
    run_id = f"bench-{tag}"
    res = grpo(config=cfg, run_id=run_id)
    wall = float(res["loop_s"])  # the steps themselves: Ray start, actor set-up and shutdown excluded
    rows = read_metrics(res["metrics_uri"])
    gen_s = sum(float(r.get("generate_s") or 0) + float(r.get("score_s") or 0) for r in rows)
    return {"wall": wall, "steps": steps, "tokens": _tokens(root, run_id, steps), "gen_s": gen_s,
            "step_wall": res.get("step_wall_s") or [], "reward": [r.get("reward_mean") for r in rows]}


def compare(label: str, config: str, overrides: list[str], steps: int, tmp: str) -> dict[str, Any]:
    sync = run(config, overrides, steps, f"{label}-sync", tmp)
    asyn = run(config, [*overrides, *ASYNC], steps, f"{label}-async", tmp)
    print(f"### {label}: {steps} steps")
    print("| run | wall s | steps/s | tokens/s | generation s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in (("sync", sync), ("async (age 1)", asyn)):
        print(f"| {name} | {r['wall']:.1f} | {r['steps'] / r['wall']:.3f} | {r['tokens'] / r['wall']:.0f} | {r['gen_s']:.1f} |")
    hidden = (sync["wall"] - asyn["wall"]) / sync["gen_s"] if sync["gen_s"] else float("nan")
    print(f"async / sync steps per second: **{sync['wall'] / asyn['wall']:.2f}x**; generation hidden behind "
          f"the policy's work: {hidden:.0%} of {sync['gen_s']:.1f} s")
    print(f"reward_mean per step, sync: {sync['reward']}\nreward_mean per step, async: {asyn['reward']}")
    return {"sync": sync, "async": asyn}


def learning(steps: int, sft_steps: int, tmp: str) -> dict[str, Any]:
    """SFT warm start once, then sync and async GRPO from it: first 3 vs last 3 steps' reward."""
    from flows.demo import DEMO_CONFIG
    from flows.algorithms.warm_start import run_sft_warm_start

    warm = run_sft_warm_start(DEMO_CONFIG, "bench-warm", steps=sft_steps, storage=os.path.join(tmp, "warm"), lr=3e-3)
    base = ["logger.step_subflows=false", "warm_start.sft_steps=0", f"policy.model_name={warm}"]
    sync = run(DEMO_CONFIG, base, steps, "learn-sync", tmp)
    asyn = run(DEMO_CONFIG, [*base, *ASYNC], steps, "learn-async", tmp)
    print(f"### learning: tiny model, SFT warm start ({sft_steps} steps), then {steps} GRPO steps")
    print("| run | reward, first 3 steps | reward, last 3 steps | wall s |")
    print("|---|---:|---:|---:|")
    for name, r in (("sync", sync), ("async (age 1)", asyn)):
        rw = [x or 0.0 for x in r["reward"]]
        print(f"| {name} | {sum(rw[:3]) / 3:.3f} | {sum(rw[-3:]) / 3:.3f} | {r['wall']:.1f} |")
    return {"sync": sync, "async": asyn}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny comparison only (make bench-quick)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-smollm", action="store_true")
    ap.add_argument("--no-learning", action="store_true")
    ap.add_argument("--learning-steps", type=int, default=80)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        quiet_env(prefect_home=os.path.join(tmp, "prefect"))
        out = {"tiny": compare("tiny", "configs/grpo_tiny.yaml", ["logger.step_subflows=false", *args.overrides], args.steps, tmp)}
        if not (args.quick or args.no_smollm):
            if smollm2_available():
                smol = ["logger.step_subflows=false", "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4",
                        *args.overrides]
                out["smollm2"] = compare("smollm2", "configs/grpo_smollm2.yaml", smol, max(3, args.steps // 2), tmp)
                # one core per lane: the policy and the generation workers do not share cores
                out["smollm2-1t"] = compare(
                    "smollm2-1-thread-per-actor", "configs/grpo_smollm2.yaml",
                    [*smol, "policy.torch_num_threads=1", "generation.torch_num_threads=1"], max(3, args.steps // 2), tmp,
                )
            else:
                print("### smollm2: skipped (the offline SmolLM2-135M package is not installed: `make smollm2`)")
        if not (args.quick or args.no_learning):
            out["learning"] = learning(args.learning_steps, args.sft_steps, tmp)
    return out


if __name__ == "__main__":
    main()
