"""Reward-model training (``nrl rm``) on SmolLM2-135M-Instruct, then GRPO scored by that reward
model against GRPO scored by the exact-match reward, side by side in one run.

    python -m benchmarks.bench_rm [--quick] [--rm-steps 24] [--grpo-steps 10] [--seed 42] [key=value ...]

1. ``rm``: ``configs/rm_smollm2.yaml`` (the base model with a new one-output head, the built-in
   arithmetic pairs: chosen the right sum, rejected a wrong one). Held-out pair accuracy before
   (step 0: the new head) and after (the last step).
2. ``grpo``: ``configs/grpo_smollm2.yaml`` twice from the same base model, prompts, seed and
   sample budget: scored by the exact-match reward, and by the reward model's final ``weights``
   (``env.reward_model``). Greedy held-out exact-match accuracy before (step 0) and after (the
   last step), and the training reward.

Per run: seconds a step split by stage (the metrics lines' ``<stage>_s``), and the peak summed PSS
of the job (this process, its local Ray and the actors). ``--quick``: the tiny model, 2 steps each
(a smoke run, not a learning result). ``key=value`` overrides apply to every run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from benchmarks._colocation import TreeMemory
from benchmarks._common import quiet_env

#: ``_s`` keys of a metrics line that are not one stage's seconds
_NOT_STAGES = ("step_s", "orchestration_s", "compute_s", "stages_s")


def stage_seconds(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds a step of each stage (the metrics lines' ``<stage>_s``, step and orchestration apart)."""
    keys = sorted({k for r in rows for k, v in r.items() if k.endswith("_s") and isinstance(v, (int, float))})
    keys = [k for k in keys if k not in _NOT_STAGES and not k.endswith("_per_s")]  # rates are not seconds
    return {k[:-2]: sum(float(r.get(k) or 0.0) for r in rows) / len(rows) for k in keys} if rows else {}


def exact_match_accuracy(root: str, run_id: str, step: int) -> float | None:
    """Greedy exact-match accuracy of a GRPO run's validation at ``step``, recomputed from its
    persisted responses (a run scored by a reward model records the model's mean score as its
    ``val_accuracy``)."""
    import storage
    from nrl_tasks.environments.arithmetic import exact_match_reward

    uri = os.path.join(root, run_id, "steps", f"step_{step:06d}", "val")
    if not storage.is_committed(uri):
        return None
    b = storage.load_batch(uri)
    rows = [i for i, m in enumerate(b["mode"]) if m == "greedy"]
    got = exact_match_reward([b["prompt"][i] for i in rows], [b["response"][i] for i in rows], [b["answer"][i] for i in rows])
    return sum(got) / len(got) if got else None


def _run(flow: Any, config: str, overrides: list[str], root: str, run_id: str) -> dict[str, Any]:
    """One run of ``flow`` on ``config`` with ``overrides``; its metrics lines, held-out accuracy
    before and after (a reward model's pair accuracy; a policy's greedy exact match) and peak PSS."""
    from benchmarks._common import val_accuracy
    from flows.config import load_config
    from flows.observe.metrics import read_metrics

    cfg = load_config(config, ["logger.console=false", "logger.step_subflows=false", f"storage.root={root}", *overrides])
    with TreeMemory() as mem:
        out = flow(config=cfg, run_id=run_id)
    rows = read_metrics(os.path.join(root, run_id, "metrics.jsonl"))
    last = out["last_step"]
    held_out = val_accuracy if cfg.kind == "rm" else exact_match_accuracy
    return {"rows": rows, "before": held_out(root, run_id, 0), "after": held_out(root, run_id, last),
            "last": last, "peak_mb": mem.peak_total_mb, "weights": os.path.join(root, run_id, "checkpoints",
                                                                               f"step_{last:06d}", "weights")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rm-steps", type=int, default=None)
    ap.add_argument("--grpo-steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    rm_config = "configs/rm_tiny.yaml" if args.quick else "configs/rm_smollm2.yaml"
    grpo_config = "configs/grpo_tiny.yaml" if args.quick else "configs/grpo_smollm2.yaml"
    rm_steps = args.rm_steps or (2 if args.quick else 24)
    grpo_steps = args.grpo_steps or (2 if args.quick else 10)
    with tempfile.TemporaryDirectory(prefix="bench-rm-") as tmp:
        quiet_env(prefect_home=os.path.join(tmp, "prefect"))
        from flows.algorithms.grpo import grpo
        from flows.algorithms.rm import rm

        root = os.path.join(tmp, "runs")
        res: dict[str, Any] = {"rm": _run(rm, rm_config, [
            f"rm.max_num_steps={rm_steps}", f"rm.seed={args.seed}", "rm.val_at_start=true", "rm.val_at_end=true",
            f"rm.val_period={rm_steps}", f"checkpointing.save_period={rm_steps}", *args.overrides], root, "bench-rm")}
        common = [f"grpo.max_num_steps={grpo_steps}", f"grpo.seed={args.seed}", "grpo.val_at_start=true",
                  f"grpo.val_period={grpo_steps}", "checkpointing.enabled=false", *args.overrides]
        res["grpo exact-match"] = _run(grpo, grpo_config, common, root, "bench-grpo-exact")
        res["grpo reward model"] = _run(grpo, grpo_config, [
            *common, "env.reward_model.enabled=true", f"env.reward_model.model_name={res['rm']['weights']}"],
            root, "bench-grpo-rm")
    report(res, rm_config, grpo_config, rm_steps, grpo_steps, args.seed)
    return res


def report(res: dict[str, Any], rm_config: str, grpo_config: str, rm_steps: int, grpo_steps: int, seed: int) -> None:
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"### reward model: {os.path.basename(rm_config)}, {rm_steps} steps; GRPO: {os.path.basename(grpo_config)}, "
          f"{grpo_steps} steps; seed {seed}")
    print("| run | held-out accuracy before | after | training figure, first step | last step | step s | stages s "
          "(mean a step) | peak job PSS MB |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for name, r in res.items():
        rows = r["rows"]
        key = "accuracy" if name == "rm" else "reward_mean"
        first, last = (rows[0].get(key), rows[-1].get(key)) if rows else (None, None)
        step_s = sum(float(x.get("step_s") or 0.0) for x in rows) / max(len(rows), 1)
        stages = ", ".join(f"{k} {v:.2f}" for k, v in stage_seconds(rows).items())
        print(f"| {name} | {fmt(r['before'])} | {fmt(r['after'])} | {key} {fmt(first)} | {fmt(last)} | {step_s:.2f} "
              f"| {stages} | {r['peak_mb']:.0f} |")
    print("(reward model: held-out pair accuracy, training pair accuracy; GRPO: greedy exact-match accuracy on the "
          "held-out prompts, mean training reward, which for the reward-model run is the model's score)")


if __name__ == "__main__":
    main()
