"""PPO with a value model (``nrl ppo``) against GRPO on SmolLM2-135M-Instruct, side by side in one run.

    python -m benchmarks.bench_ppo [--quick] [--steps 8] [--val-every 2] [--seed 42] [key=value ...]

``configs/ppo_smollm2.yaml`` and ``configs/grpo_smollm2.yaml`` from the same base model, prompts,
seed and sample budget (8 prompts x 4 samples a step), ``--steps`` steps each. Greedy held-out
exact-match accuracy every ``--val-every`` steps, the training reward, seconds a step split by stage
(PPO's ``values``, ``gae`` and ``train``: the value model's and the policy's passes) and the peak
summed PSS of each run (this process, its local Ray, the actors: PPO holds a second model).
``--quick``: the tiny model, 2 steps each (a smoke run, not a learning result). ``key=value``
overrides apply to both runs' shared sections (``policy.*``, ``data.*``, ...).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from benchmarks._common import quiet_env
from benchmarks.bench_distill import curve_table
from benchmarks.bench_rm import _run, exact_match_accuracy


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--val-every", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    steps = args.steps or (2 if args.quick else 8)
    every = min(args.val_every, steps)
    configs = {"ppo": "configs/ppo_tiny.yaml" if args.quick else "configs/ppo_smollm2.yaml",
               "grpo": "configs/grpo_tiny.yaml" if args.quick else "configs/grpo_smollm2.yaml"}
    with tempfile.TemporaryDirectory(prefix="bench-ppo-") as tmp:
        quiet_env(prefect_home=os.path.join(tmp, "prefect"))
        from flows.algorithms.grpo import grpo
        from flows.algorithms.ppo import ppo

        root = os.path.join(tmp, "runs")
        res: dict[str, Any] = {}
        for name, flow in (("ppo", ppo), ("grpo", grpo)):
            extra = ["ppo.policy_training_start_step=0"] if args.quick and name == "ppo" else []
            res[name] = _run(flow, configs[name], [
                f"{name}.max_num_steps={steps}", f"{name}.seed={args.seed}", f"{name}.val_at_start=true",
                f"{name}.val_period={every}", "checkpointing.enabled=false", *extra, *args.overrides], root, f"bench-{name}")
            res[name]["curve"] = {s: exact_match_accuracy(root, f"bench-{name}", s) for s in range(0, steps + 1, every)}
    print(f"### PPO (value model, GAE) vs GRPO, {steps} steps each, seed {args.seed}: {os.path.basename(configs['ppo'])}, "
          f"{os.path.basename(configs['grpo'])}")
    curve_table(res)
    for name, r in res.items():
        rewards = [x.get("reward_mean") for x in r["rows"]]
        print(f"- {name}: training reward by step {', '.join('n/a' if v is None else f'{v:.3f}' for v in rewards)}")
    value = [x.get("value_loss") for x in res["ppo"]["rows"]]
    print(f"- ppo value loss by step {', '.join('n/a' if v is None else f'{v:.4f}' for v in value)}")
    print("(greedy exact-match accuracy on the held-out prompts; both runs draw the same prompts and samples a step)")
    return res


if __name__ == "__main__":
    main()
