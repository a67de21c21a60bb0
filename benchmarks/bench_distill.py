"""On-policy distillation (``nrl distill``) against GRPO alone, on SmolLM2-135M-Instruct, side by side
in one run.

    python -m benchmarks.bench_distill [--quick] [--teacher-steps 12] [--steps 8] [--val-every 2] [--seed 42] [key=value ...]

1. ``teacher``: GRPO (``configs/grpo_smollm2.yaml``) trains the base model for ``--teacher-steps``;
   its final ``weights`` are the teacher.
2. ``distill``: the base model distilled from that teacher (``configs/distillation_smollm2.yaml``:
   mixed KL on the teacher's top 64), ``--steps`` steps.
3. ``grpo``: the base model trained by GRPO alone, ``--steps`` steps.

Both student runs draw the same prompts with the same seed and the same sample budget (8 prompts x
4 samples a step). Greedy held-out exact-match accuracy of the student every ``--val-every``
steps (the accuracy per step, and per sample drawn), the teacher's before and after; seconds a
step split by stage and the peak summed PSS of each run (this process, its local Ray, the
actors). ``--quick``: the tiny model, 2 steps each (a smoke run, not a learning result).
``key=value`` overrides apply to the two student runs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from benchmarks._common import quiet_env
from benchmarks.bench_rm import _run, exact_match_accuracy, stage_seconds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--teacher-steps", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--val-every", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    grpo_config = "configs/grpo_tiny.yaml" if args.quick else "configs/grpo_smollm2.yaml"
    distill_config = "configs/distillation_tiny.yaml" if args.quick else "configs/distillation_smollm2.yaml"
    teacher_steps = args.teacher_steps or (2 if args.quick else 12)
    steps = args.steps or (2 if args.quick else 8)
    every = min(args.val_every, steps)
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as tmp:
        quiet_env(prefect_home=os.path.join(tmp, "prefect"))
        from flows.algorithms.distill import distill
        from flows.algorithms.grpo import grpo

        root = os.path.join(tmp, "runs")
        res: dict[str, Any] = {"teacher (grpo)": _run(grpo, grpo_config, [
            f"grpo.max_num_steps={teacher_steps}", f"grpo.seed={args.seed}", "grpo.val_at_start=true",
            f"grpo.val_period={teacher_steps}", f"checkpointing.save_period={teacher_steps}"], root, "bench-teacher")}
        teacher = res["teacher (grpo)"]["weights"]
        res["distill"] = _run(distill, distill_config, [
            f"distillation.max_num_steps={steps}", f"distillation.seed={args.seed}", "distillation.val_at_start=true",
            f"distillation.val_period={every}", "checkpointing.enabled=false", f"teacher.model_name={teacher}",
            *(["distillation.num_prompts_per_step=4", "distillation.num_generations_per_prompt=4"] if args.quick else []),
            *args.overrides], root, "bench-distill")  # the quick run: GRPO's tiny sample budget
        res["grpo"] = _run(grpo, grpo_config, [
            f"grpo.max_num_steps={steps}", f"grpo.seed={args.seed}", "grpo.val_at_start=true", f"grpo.val_period={every}",
            "checkpointing.enabled=false", *args.overrides], root, "bench-grpo")
        for name in ("distill", "grpo"):
            run_id = "bench-" + name
            res[name]["curve"] = {s: exact_match_accuracy(root, run_id, s) for s in range(0, steps + 1, every)}
    report(res, steps, args.seed)
    return res


def curve_table(runs: dict[str, dict[str, Any]]) -> list[int]:
    """Print a markdown table of each run's held-out accuracy at its validated steps (its ``curve``),
    seconds a step, stage seconds and peak PSS; returns the steps (the columns)."""
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    curve_steps = sorted(next(iter(runs.values()))["curve"])
    print("| run | " + " | ".join(f"acc @ step {s}" for s in curve_steps) + " | step s | stages s (mean a step) | peak job PSS MB |")
    print("|---|" + "---:|" * len(curve_steps) + "---:|---|---:|")
    for name, r in runs.items():
        step_s = sum(float(x.get("step_s") or 0.0) for x in r["rows"]) / max(len(r["rows"]), 1)
        stages = ", ".join(f"{k} {v:.2f}" for k, v in stage_seconds(r["rows"]).items())
        print(f"| {name} | " + " | ".join(fmt(r["curve"].get(s)) for s in curve_steps)
              + f" | {step_s:.2f} | {stages} | {r['peak_mb']:.0f} |")
    return curve_steps


def report(res: dict[str, Any], steps: int, seed: int) -> None:
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    t = res["teacher (grpo)"]
    print(f"### distillation vs GRPO, {steps} steps each, seed {seed}; the teacher: GRPO {t['last']} steps, held-out "
          f"accuracy {fmt(t['before'])} -> {fmt(t['after'])}")
    curve_steps = curve_table({name: res[name] for name in ("distill", "grpo")})
    stages = ", ".join(f"{k} {v:.2f}" for k, v in stage_seconds(t["rows"]).items())
    cells = [f"{fmt(t['before'])} (its step 0)", *[""] * (len(curve_steps) - 2), f"{fmt(t['after'])} (its step {t['last']})"]
    step_s = sum(float(x.get("step_s") or 0.0) for x in t["rows"]) / max(len(t["rows"]), 1)
    print("| teacher (grpo) | " + " | ".join(cells) + f" | {step_s:.2f} | {stages} | {t['peak_mb']:.0f} |")
    print("(greedy exact-match accuracy on the held-out prompts; both student runs draw the same prompts and samples a step)")


if __name__ == "__main__":
    main()
