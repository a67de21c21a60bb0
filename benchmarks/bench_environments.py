"""Multi-turn environments: SmolLM2-135M-Instruct learning the built-in calculator tool and the
guessing game through the GRPO flow, and the calculator's single-turn run beside it.

    python -m benchmarks.bench_environments [--quick] [--cases ...] [--seeds 0 1 2] [--steps 25] [key=value ...]

Cases (each one GRPO run per seed, 8 prompts x 4 samples a step, chat template on):

- ``calculator``: ``env.environment=calculator``, ``grpo.max_rollout_turns=3``, products of two
  numbers up to 999 (the model cannot multiply them in its head): call the tool, read the result,
  answer. Warm start (``warm_start.sft_steps``): SFT on the prompts' demonstrations (tool call,
  result, answer: the ``demonstration`` column);
- ``calculator-single-turn``: the same prompts and reward with ``grpo.max_rollout_turns=1`` and
  the same SFT budget on direct answers (the file without its ``demonstration`` column): the
  model must answer in its first turn;
- ``guess_number``: ``env.environment=guess_number``, up to 6 turns, a secret in 1..16 (reward
  ``0.8 ** (turns - 1)`` when found); warm start: SFT on the built-in prompts' demonstrations (the
  game played by bisection: guesses and replies).

Both calculator cases read one prompt file the benchmark writes (``data.dataset=file``), so their
prompts are the same. Per run and step, read from the persisted rollouts: the success rate
(episodes with a positive reward), turns per episode, and the environment's seconds as a share of
the step wall time (from ``metrics.jsonl``). Prints one row per (case, seed): success over the
first and last 5 steps, turns, environment share; then per case how many seeds rose.
``--quick``: the tiny model, 1 seed, 2 steps, 2 SFT steps (a smoke run, not a learning result).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from benchmarks._common import quiet_env

_CALC = ["env.environment=calculator", "data.dataset=file", "generation.max_new_tokens=40",
         "policy.max_total_sequence_length=384"]
CASES: dict[str, list[str]] = {
    "calculator": [*_CALC, "grpo.max_rollout_turns=3"],
    "calculator-single-turn": [*_CALC, "grpo.max_rollout_turns=1"],
    "guess_number": ["data.dataset=guess_number", "env.environment=guess_number", "data.arithmetic.max_operand=16",
                     "grpo.max_rollout_turns=6", "generation.max_new_tokens=8", "policy.max_total_sequence_length=320"],
}


def calculator_files(tmp: str, num: int = 512) -> dict[str, str]:
    """One prompt file per calculator case: the same problems, with and without demonstrations."""
    from nrl_tasks.environments.calculator import make_calculator_prompts

    recs = make_calculator_prompts(num, seed=1234, max_operand=999)
    paths = {"calculator": os.path.join(tmp, "calculator.jsonl"), "calculator-single-turn": os.path.join(tmp, "direct.jsonl")}
    for case, path in paths.items():
        with open(path, "w", encoding="utf-8") as fh:
            for r in recs:
                row = r if case == "calculator" else {"prompt": r["prompt"], "answer": r["answer"]}
                fh.write(json.dumps(row) + "\n")
    return paths


def step_figures(root: str, run_id: str, steps: int) -> list[dict[str, float]]:
    """Per step: success rate, mean turns, environment seconds and step wall seconds."""
    import storage
    from flows.observe.metrics import read_metrics

    metrics = {int(r["step"]): r for r in read_metrics(os.path.join(root, run_id, "metrics.jsonl"))}
    out = []
    for step in range(1, steps + 1):
        r = storage.load_batch(os.path.join(root, run_id, "steps", f"step_{step:06d}", "rollouts"))
        m = metrics.get(step, {})
        out.append({
            "success": float((r["env_rewards"] > 0).float().mean()), "turns": float(r["num_turns"].float().mean()),
            "env_s": float(m.get("env_seconds") or 0.0), "step_s": float(m.get("step_s") or 0.0),
        })
    return out


def run(config: str, overrides: list[str], steps: int, seed: int, tag: str, tmp: str) -> list[dict[str, float]]:
    """One GRPO run (its warm start first, where the overrides ask for one); per-step figures."""
    from flows.algorithms.grpo import grpo
    from flows.config import load_config

    root = os.path.join(tmp, tag)
    cfg = load_config(config, [
        f"grpo.max_num_steps={steps}", f"grpo.seed={seed}", "grpo.val_period=0", "data.chat_template=true",
        "checkpointing.enabled=false", "logger.step_subflows=false", "logger.console=false", f"storage.root={root}",
        *overrides,
    ])
    run_id = f"env-{tag}"
    grpo(config=cfg, run_id=run_id)
    return step_figures(root, run_id, steps)


def summarize(per_step: list[dict[str, float]]) -> dict[str, float]:
    k = max(1, min(5, len(per_step) // 2))  # first and last k steps: 5 of 25, 3 of 6
    mean = lambda key, rows: sum(r[key] for r in rows) / max(len(rows), 1)  # noqa: E731
    env_s, step_s = sum(r["env_s"] for r in per_step), sum(r["step_s"] for r in per_step)
    return {"first": mean("success", per_step[:k]), "last": mean("success", per_step[-k:]),
            "turns_first": mean("turns", per_step[:k]), "turns_last": mean("turns", per_step[-k:]),
            "env_share": env_s / step_s if step_s else float("nan"), "step_s": step_s / max(len(per_step), 1)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", nargs="*", choices=sorted(CASES), default=None)
    ap.add_argument("--seeds", type=int, nargs="*", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--sft-steps", type=int, default=None, help="warm start of every case (default 6; 24 take the calculator to 100%%)")
    ap.add_argument("--sft-lr", type=float, default=5e-5)
    ap.add_argument("--json", default=None, help="also write the per-step figures here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    config = "configs/grpo_tiny.yaml" if args.quick else "configs/grpo_smollm2.yaml"
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    steps = args.steps or (2 if args.quick else 25)
    cases = args.cases or list(CASES)
    out: dict[str, list[list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-environments-") as tmp:
        quiet_env(prefect_home=os.path.join(tmp, "prefect"))
        files = calculator_files(tmp)
        sft_steps = args.sft_steps if args.sft_steps is not None else (2 if args.quick else 6)
        for case in cases:
            warm = [f"warm_start.sft_steps={sft_steps}", "warm_start.batch_size=16", f"warm_start.lr={args.sft_lr}"]
            extra = [f"data.train_path={files[case]}", *warm] if case in files else warm
            out[case] = [run(config, [*CASES[case], *extra, *args.overrides], steps, s, f"{case}-s{s}", tmp) for s in seeds]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    print(f"### environments: {os.path.basename(config)}, {steps} steps of 8 x 4, seeds {seeds}")
    k = max(1, min(5, steps // 2))
    print(f"| case | seed | success, first {k} steps | last {k} | turns, first {k} | last {k} | step s | environment share |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for case, runs in out.items():
        for s, per_step in zip(seeds, runs):
            f = summarize(per_step)
            print(f"| {case} | {s} | {f['first']:.3f} | {f['last']:.3f} | {f['turns_first']:.2f} | {f['turns_last']:.2f} "
                  f"| {f['step_s']:.1f} | {f['env_share']:.2%} |")
    for case, runs in out.items():
        rows = [summarize(p) for p in runs]
        rose = sum(1 for f in rows if f["last"] > f["first"])
        print(f"{case}: success rose in {rose} of {len(rows)} seeds; mean success, last {k} steps: "
              f"{sum(f['last'] for f in rows) / len(rows):.3f}")
    return out


if __name__ == "__main__":
    main()
