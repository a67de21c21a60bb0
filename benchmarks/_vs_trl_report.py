"""The tables of ``benchmarks/bench_vs_trl.py`` and the differences that remain between the two systems."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import Any

#: What still differs between TRL's side and ours after matching the settings one to one.
DIFFERENCES = [
    "sampling draws: ours give each row its own torch.Generator seeded from (seed, step, row) and draw with "
    "torch.multinomial per row; TRL's HF generate draws for the whole batch from torch's global generator "
    "(set_seed(seed)). Same distribution (softmax of logits / T, no top-k, top-p 1), different samples.",
    "decoder: ours is this project's KV-cache loop (prompts left-padded inside, explicit position ids, finished rows "
    "dropped from the batch, each distinct prompt prefilled once and its KV cache shared by its 4 rows); TRL's is HF "
    "generate (left-padded prompts, each of the 32 rows prefilled). Both stop at <|im_end|> (the tokenizer's and "
    "the model's EOS) or 16 tokens, no stop strings; the completion mask keeps the EOS token in both.",
    "training forward: ours runs each prompt of a micro-batch once and its rows' completions on its KV cache "
    "(policy.share_prompt_prefix, same loss and gradient to float32 rounding: tests/models/policy/"
    "test_prefix_sharing.py); TRL runs all 32 prompt + completion rows and computes logits for the completion "
    "positions only (logits_to_keep).",
    "held-out greedy accuracy: ours from the flow's val stage (this project's decoder, argmax), TRL's from HF generate "
    "(do_sample=False) in the driver; same prompts, same reward, same 16 tokens.",
    "weights: both generate with the model they train (ours: generation.colocated.enabled, inside the policy actor, "
    "no refit); TRL in its one process, ours in a Ray actor the flow process calls.",
    "TRL shuffles the generated batch before cutting it into its 4 micro-batches of 8; ours keep the rollout order. "
    "The loss is a sum over all tokens of the batch divided by their count on both sides, so the update is the same "
    "up to float summation order.",
    "advantage statistics: ours in float64 then rounded to float32; TRL's in float32 (under 1 ulp apart).",
    "TRL runs with bf16=False and gradient_checkpointing=False (its defaults are True and True) to train in float32 "
    "without activation checkpointing like ours; TRL's process is one torch process with 2 threads, ours is one Ray "
    "actor with 2 threads (generation and training take turns in it) plus the flow process and a Prefect API server.",
]

_NUM = re.compile(r"-?\d+")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _steady(xs: list[Any]) -> list[Any]:
    """Steps 2..N (step 1 warms up), or all of them when there is only one."""
    return xs[1:] if len(xs) > 1 else xs


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and v != v) else format(v, spec)


def response_shape(responses: list[str]) -> str:
    """The most common greedy response with its integers written ``N``, and its share."""
    if not responses:
        return "n/a"
    shape, n = Counter(_NUM.sub("N", r.strip()) for r in responses).most_common(1)[0]
    return f"{n}/{len(responses)} {shape[:40]!r}"


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Medians over steps 2..N and the totals one row of the table shows."""
    steps = _steady(run["step_s"])
    toks = _steady(run["new_tokens"])
    split = _steady(run["split"])
    rewards = run["rewards"]
    k = min(5, len(rewards))
    return {
        "before": run["val_before"], "after": run["val_after"],
        "reward_first": sum(rewards[:k]) / max(1, k), "reward_last": sum(rewards[-k:]) / max(1, k),
        "step_median_s": _median(steps),
        "split": {key: _median([s[key] for s in split]) for key in (split[0] if split else {})},
        "tokens_per_s": sum(toks) / sum(steps) if steps and sum(steps) > 0 else float("nan"),
        "peak_gb": run["peak_mb"] / 1000, "wall_s": run["wall_s"], "shape": response_shape(run.get("responses_after", [])),
    }


def print_report(results: dict[str, Any]) -> None:
    runs = results["runs"]
    print(f"\n### TRL GRPOTrainer vs nrl grpo: {results['config']} {' '.join(results['overrides'])}, "
          f"{results['steps']} steps of 8 x 4, {results['val']} held-out prompts")
    print("| seed | system | greedy acc before | after | train reward steps 1-5 | last 5 | median step s | "
          "gen tokens/s | peak RSS GB | wall s | most common greedy answer after |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    sums: dict[str, dict[Any, dict[str, Any]]] = {}
    for seed, by_sys in runs.items():
        for name, run in by_sys.items():
            s = sums.setdefault(name, {})[seed] = summarize(run)
            print(f"| {seed} | {name} | {_fmt(s['before'])} | {_fmt(s['after'])} | {s['reward_first']:.3f} | "
                  f"{s['reward_last']:.3f} | {s['step_median_s']:.2f} | {s['tokens_per_s']:.1f} | {s['peak_gb']:.2f} | "
                  f"{s['wall_s']:.0f} | {s['shape']} |")

    print("\nWhere a step's seconds go (medians of steps 2..N; ours without the validation):")
    for name, by_seed in sums.items():
        for seed, s in by_seed.items():
            parts = ", ".join(f"{k} {v:.2f}" for k, v in s["split"].items())
            print(f"  {name} seed {seed}: step {s['step_median_s']:.2f} s = {parts}")

    print("\nTraining reward by step:")
    for seed, by_sys in runs.items():
        for name, run in by_sys.items():
            print(f"  {name} seed {seed}: " + " ".join(f"{r:.2f}" for r in run["rewards"]))

    if {"trl", "nrl"} <= set(sums):
        print("\nSide by side (nrl vs TRL):")
        print("| seed | acc after nrl - TRL | step time nrl / TRL | speed nrl / TRL | peak RSS nrl / TRL |")
        print("|---:|---:|---:|---:|---:|")
        for seed in runs:
            if seed not in sums["trl"] or seed not in sums["nrl"]:
                continue
            t, n = sums["trl"][seed], sums["nrl"][seed]
            diff = None if n["after"] is None or t["after"] is None else n["after"] - t["after"]
            ratio = n["step_median_s"] / t["step_median_s"] if t["step_median_s"] else float("nan")
            print(f"| {seed} | {_fmt(diff, '+.3f')} | {ratio:.2f} | {1 / ratio:.2f}x | {n['peak_gb'] / t['peak_gb']:.2f} |")
    for name, by_seed in sums.items():
        after = [s["after"] for s in by_seed.values() if s["after"] is not None]
        rose = sum(1 for s in by_seed.values() if s["after"] is not None and s["before"] is not None and s["after"] > s["before"])
        med = _median([s["step_median_s"] for s in by_seed.values()])
        print(f"{name}: mean greedy accuracy after {_fmt(sum(after) / len(after) if after else None)}, rose in {rose} of "
              f"{len(by_seed)} seeds, median step {med:.2f} s")
    if {"trl", "nrl"} <= set(sums):
        t_med = _median([s["step_median_s"] for s in sums["trl"].values()])
        n_med = _median([s["step_median_s"] for s in sums["nrl"].values()])
        print(f"goal: nrl mean accuracy >= TRL's, nrl median step <= 0.8x TRL's (now {n_med / t_med:.2f}x), rising in every seed")

    print("\nChecks:")
    for seed, by_sys in runs.items():
        for name, run in by_sys.items():
            extra = f", TRL tokenised {run['token_id_mismatches']} prompts differently" if "token_id_mismatches" in run else ""
            skipped = f", logprob stage skipped: {run['logprob_skipped']}" if "logprob_skipped" in run else ""
            print(f"  {name} seed {seed}: prompts in the shared order: {run.get('prompt_order_matches')}{extra}{skipped}")
    print("\nDifferences that remain:")
    for d in results["differences"]:
        print(f"  - {d}")
