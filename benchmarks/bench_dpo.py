"""DPO vs supervised fine-tuning on the chosen responses, side by side in one run.

    python -m benchmarks.bench_dpo [--quick] [--steps N] [key=value ...]

Two ``nrl dpo`` runs (``flows.algorithms.dpo.dpo``) on the same pairs and seed: DPO (``preference_loss_weight
1``, ``sft_loss_weight 0``) and the baseline, SFT on the chosen responses only (``preference_loss_weight
0``, ``sft_loss_weight 1``: NeMo-RL's DPO loss with the preference term off). DPO raises the
chosen-vs-rejected margin directly; SFT raises the chosen responses' likelihood and the
rejected ones' with them when they look alike. Prints per run the implicit-reward margin and
preference accuracy (first 3 vs last 3 steps, measured on each step's pairs before its update)
and the median step seconds. Default: SmolLM2-135M-Instruct on the built-in arithmetic pairs;
``--quick``: the tiny model (``configs/dpo_tiny.yaml``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any

from benchmarks._common import quiet_env

BASE = ["logger.console=false", "checkpointing.enabled=false"]
SMOLLM2 = [  # configs/grpo_smollm2.yaml's policy, on DPO pairs
    "dpo.reference_policy_kl_penalty=0.1", "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4",
    "policy.optimizer.kwargs.lr=5.0e-6", "data.arithmetic.num_train=64", "data.arithmetic.few_shot=0",
]


def run(config: str, overrides: list[str], steps: int, tag: str, tmp: str) -> dict[str, Any]:
    from flows.config import load_config
    from flows.algorithms.dpo import dpo
    from flows.observe.metrics import read_metrics

    cfg = load_config(config, [*BASE, *overrides, f"dpo.max_num_steps={steps}", f"storage.root={os.path.join(tmp, tag)}"])
    rows = read_metrics(dpo(config=cfg, run_id=f"bench-{tag}")["metrics_uri"])
    mean = lambda k, rs: statistics.mean(float(r[k]) for r in rs)  # noqa: E731
    return {"margin": (mean("rewards_margin_mean", rows[:3]), mean("rewards_margin_mean", rows[-3:])),
            "accuracy": (mean("accuracy", rows[:3]), mean("accuracy", rows[-3:])),
            "step_s": statistics.median(float(r["step_s"]) for r in rows[1:] or rows)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.quick:
        config, setting, steps = "configs/dpo_tiny.yaml", [], 12
    else:
        config, setting, steps = "configs/grpo_smollm2.yaml", SMOLLM2, 16
    steps = args.steps or steps
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as tmp:
        quiet_env(prefect_home=os.path.join(tmp, "prefect"))
        sft = run(config, [*setting, "dpo.preference_loss_weight=0", "dpo.sft_loss_weight=1", *args.overrides], steps, "sft", tmp)
        dpo_r = run(config, [*setting, "dpo.preference_loss_weight=1", "dpo.sft_loss_weight=0", *args.overrides], steps, "dpo", tmp)
    print(f"### DPO vs SFT on the chosen responses: {os.path.basename(config)}, {steps} steps")
    print("| run | margin first 3 -> last 3 | accuracy first 3 -> last 3 | step s |")
    print("|---|---|---|---:|")
    for name, r in (("SFT on chosen (baseline)", sft), ("DPO", dpo_r)):
        print(f"| {name} | {r['margin'][0]:.4f} -> {r['margin'][1]:.4f} | {r['accuracy'][0]:.3f} -> {r['accuracy'][1]:.3f} | "
              f"{r['step_s']:.2f} |")
    gain = lambda r: r["margin"][1] - r["margin"][0]  # noqa: E731
    print(f"margin gain DPO / SFT: **{gain(dpo_r) / gain(sft):.2f}x**" if abs(gain(sft)) > 1e-9 else
          f"margin gain DPO {gain(dpo_r):.4f}, SFT {gain(sft):.4f}")
    return {"sft": sft, "dpo": dpo_r}


if __name__ == "__main__":
    main()
