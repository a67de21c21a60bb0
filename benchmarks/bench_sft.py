"""SFT first-class: SmolLM2-135M-Instruct's greedy accuracy on the built-in task, before and after ``nrl sft``.

    python -m benchmarks.bench_sft [--quick] [--steps 30] [key=value ...]

One machine, one run each, the same held-out prompts (the built-in task's validation split,
single-digit addition without few-shot examples) and the same generation settings (greedy, 6 new
tokens, stop at the end of the line; ``configs/grpo_smollm2.yaml``), side by side:

- **base**: the model as it ships, its greedy accuracy measured by a GRPO run's validation of the
  initial weights (``grpo.val_at_start``; the run trains one step afterwards, not counted);
- **SFT**: ``--steps`` SFT steps (``flows.algorithms.sft``, 32 rows a step, the task's reference
  answers, AdamW lr 1e-5 as the GRPO config) with its held-out loss validated, then ``nrl eval`` of
  its checkpoints (half way and last) on the same prompts.

Prints the accuracies, the SFT loss of the first and last steps, the held-out loss before and
after, and the median SFT step time. ``--quick``: the tiny model, 6 steps (a smoke run, not a
learning result).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any

from benchmarks._common import quiet_env, val_accuracy

SMOLLM2 = "configs/grpo_smollm2.yaml"
TINY = "configs/grpo_tiny.yaml"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None, help="SFT learning rate (default: the config's)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    quiet_env()
    from flows.algorithms.evaluate import evaluate_checkpoint
    from flows.algorithms.grpo import grpo
    from flows.algorithms.sft import sft
    from flows.config import load_config
    from flows.observe.metrics import read_metrics

    config = TINY if args.quick else SMOLLM2
    steps = args.steps or (6 if args.quick else 30)
    base_over = ["data.arithmetic.few_shot=0", "logger.console=false", "logger.step_subflows=false", *args.overrides]
    tmp = tempfile.mkdtemp(prefix="bench-sft-")
    root = os.path.join(tmp, "runs")
    # base: a GRPO run's validation of the initial weights
    grpo(config=load_config(config, [*base_over, "grpo.max_num_steps=1", "grpo.val_at_start=true", "grpo.val_period=1",
                                     "checkpointing.enabled=false", f"storage.root={root}"]), run_id="base")
    base = val_accuracy(root, "base", 0)
    # SFT on the same task, then nrl eval of its checkpoints on the same prompts and generation settings
    half = max(1, steps // 2)
    sft_over = [*base_over, f"sft.max_num_steps={steps}", f"sft.val_period={half}", "sft.val_at_start=true",
                "sft.val_global_batch_size=32", "sft.val_micro_batch_size=8", f"checkpointing.save_period={half}",
                f"storage.root={root}", *([f"policy.optimizer.kwargs.lr={args.lr}"] if args.lr else [])]
    data = load_config(config).model_dump(mode="json")
    data["sft"] = {"max_num_steps": steps}
    out = sft(config=data, run_id="sft", overrides=sft_over)
    rows = read_metrics(out["metrics_uri"])
    evals = {}
    for step in sorted({half, steps}):
        res = evaluate_checkpoint(run_id="sft", checkpoint=f"step_{step:06d}", storage=root, num_samples=0)
        evals[step] = res.get("eval_accuracy")
    import storage

    start_loss = storage.read_manifest(os.path.join(root, "sft", "steps", "step_000000", "val")).meta.get("val_loss")
    val = {int(r["step"]): r.get("val_loss") for r in rows if r.get("val_loss") is not None}
    step_s = statistics.median(r["step_s"] for r in rows[1:] if r.get("step_s")) if len(rows) > 1 else None
    label = "tiny model (smoke run)" if args.quick else "SmolLM2-135M-Instruct"
    print(f"### SFT on the built-in task: {label}, {steps} steps of 32 rows, greedy accuracy on the same held-out prompts")
    print("| model | greedy accuracy | held-out loss |")
    print("|---|---:|---:|")
    print(f"| base (as shipped) | {base} | {start_loss:.4f} |")
    for step, acc in evals.items():
        print(f"| after SFT step {step} | {acc} | {val.get(step, float('nan')):.4f} |")
    print(f"SFT train loss: first step {rows[0].get('loss'):.4f}, last step {rows[-1].get('loss'):.4f}; "
          f"median step {step_s:.2f} s" if step_s else "")
    return {"base": base, "evals": evals, "val_loss": {0: start_loss, **val}, "step_s": step_s}


if __name__ == "__main__":
    main()
