"""The ``logprob`` stage skipped when nothing reads it, side by side in one run.

    python -m benchmarks.bench_logprob_skip [--quick] [--steps N] [key=value ...]

Two GRPO runs through ``flows.algorithms.grpo.grpo`` with one optimizer step per rollout batch and no KL
term: the default ratio (``pi / pi_old``: the ``logprob`` stage computes ``prev_logprobs``, which
equal the trainer's own logprobs at that moment) and ``loss_fn.force_on_policy_ratio=true`` (ratio
``exp(log pi - sg(log pi)) = 1``: nothing reads the step's logprobs, the stage does not run). The
same update either way up to float rounding. Prints per run the median step wall (steps 2..N) and
its stages. Default: SmolLM2-135M-Instruct, 8 prompts x 4 samples, 16 new tokens (the issue's
setting; minutes on 2 cores); ``--quick``: the tiny model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any

from benchmarks._common import quiet_env

BASE = ["logger.step_subflows=false", "checkpointing.enabled=false", "grpo.val_period=0", "logger.console=false",
        "loss_fn.reference_policy_kl_penalty=0.0"]


def run(config: str, overrides: list[str], steps: int, tag: str, tmp: str) -> dict[str, Any]:
    from flows.config import load_config
    from flows.algorithms.grpo import grpo
    from flows.observe.metrics import read_metrics

    root = os.path.join(tmp, tag)
    cfg = load_config(config, [*BASE, *overrides, f"grpo.max_num_steps={steps}", f"storage.root={root}"])
    res = grpo(config=cfg, run_id=f"bench-{tag}")
    rows = read_metrics(res["metrics_uri"])[1:] or read_metrics(res["metrics_uri"])  # step 1 warms up
    med = lambda k: statistics.median(float(r.get(k) or 0.0) for r in rows)  # noqa: E731
    return {k: med(k) for k in ("step_s", "generate_s", "logprob_s", "train_s", "refit_s")} | {
        "skipped": all(r.get("logprob_skipped") for r in rows), "reward": [r.get("reward_mean") for r in rows]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.quick:
        config, setting = "configs/grpo_tiny.yaml", []
    else:
        config = "configs/grpo_smollm2.yaml"
        setting = ["grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=32",
                   "generation.max_new_tokens=16"]
    with tempfile.TemporaryDirectory(prefix="bench-lpskip-") as tmp:
        quiet_env(prefect_home=os.path.join(tmp, "prefect"))
        base = run(config, [*setting, *args.overrides], args.steps, "ratio", tmp)
        skip = run(config, [*setting, "loss_fn.force_on_policy_ratio=true", *args.overrides], args.steps, "on-policy", tmp)
    print(f"### logprob skip: {os.path.basename(config)}, {args.steps} steps (medians of steps 2..{args.steps})")
    print("| run | logprob stage | step s | generate s | logprob s | train s | refit s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, r in (("pi / pi_old (baseline)", base), ("force_on_policy_ratio", skip)):
        lp = "skipped" if r["skipped"] else "runs"
        print(f"| {name} | {lp} | {r['step_s']:.2f} | {r['generate_s']:.2f} | {r['logprob_s']:.2f} | {r['train_s']:.2f} | {r['refit_s']:.2f} |")
    print(f"step time with the skip / without: **{skip['step_s'] / base['step_s']:.2f}x** "
          f"({base['step_s'] - skip['step_s']:.2f} s less per step)")
    print(f"reward_mean per step, baseline: {base['reward']}\nreward_mean per step, skip: {skip['reward']}")
    return {"baseline": base, "skip": skip}


if __name__ == "__main__":
    main()
