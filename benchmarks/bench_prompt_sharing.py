"""Shared prompts in the policy's train forward, side by side in one run.

    python -m benchmarks.bench_prompt_sharing [--quick] [--repeats N]

One ``PolicyWorker`` in this process (2 torch threads, no Ray), one GRPO batch shaped like
``configs/grpo_smollm2_vs_trl.yaml``'s (8 chat-template prompts of single-digit products x 4
sampled completions of up to 16 tokens, sampled here by the policy itself), trained with
``policy.share_prompt_prefix`` off (every row runs its whole prompt) and on (each prompt once, the
prompts' common start once when a micro-batch holds 4 or more), at micro-batches of 8 and 32
rows. The weights and optimizer state are reset before every ``train`` call, so each call does
the same work; the figure is the median seconds of a ``train`` call (forward, backward,
AdamW step) over ``--repeats`` rounds, the variants interleaved in each round. Also printed:
prompt tokens the forward did not run again, and the loss and gradient norm of each variant
(equal to float32 rounding). ``--quick``: the tiny model.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
from typing import Any

from benchmarks._common import quiet_env

GROUPS, SAMPLES, NEW_TOKENS = 8, 4, 16


def build_batch(worker: Any, tokenizer: Any, chat: bool) -> Any:
    """A GRPO train batch: prompts x samples sampled by ``worker``'s model, random advantages."""
    import torch

    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
    from nrl_tasks.models.generation.hf_sampling import generate_batch

    questions = [f"What is {a} * {b}?" for a, b in [(3, 7), (6, 8), (2, 9), (4, 4), (7, 5), (9, 3), (8, 6), (5, 2)]]
    prompts = []
    for q in questions[:GROUPS]:
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        else:
            ids = tokenizer(q)["input_ids"]
        prompts += [ids] * SAMPLES
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts])
    worker.model.eval()
    out = generate_batch(worker.model, tokenizer, input_ids, lengths, max_new_tokens=NEW_TOKENS,
                         seeds=torch.arange(len(prompts)))
    worker.model.train()
    ids, total = out["output_ids"], out["unpadded_sequence_lengths"]
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    token_mask = ((positions >= lengths.unsqueeze(1)) & (positions < total.unsqueeze(1))).float()
    g = torch.Generator().manual_seed(0)
    return BatchedDataDict({
        "input_ids": ids, "input_lengths": total, "token_mask": token_mask, "sample_mask": torch.ones(len(prompts)),
        "advantages": torch.randn(len(prompts), 1, generator=g) * token_mask,
        "prev_logprobs": torch.zeros(ids.shape), "generation_logprobs": torch.zeros(ids.shape),
        "reference_policy_logprobs": torch.zeros(ids.shape),
    })


def tokens_saved(batch: Any, mbs: int) -> tuple[int, int]:
    """``(prompt tokens not run again, tokens of the padded rows)`` over the micro-batches."""
    from nrl_tasks.models.policy.workers.prefix_sharing import prefix_lengths_from_mask, prefix_plan

    saved = 0
    for start in range(0, batch.size, mbs):
        mb = batch.slice(start, min(batch.size, start + mbs))
        plan = prefix_plan(mb["input_ids"], mb["input_lengths"],
                           prefix_lengths_from_mask(mb["token_mask"], mb["input_lengths"]))
        saved += plan.tokens_saved if plan is not None else 0
    return saved, batch.size * batch["input_ids"].shape[1]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny model (smoke run)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    quiet_env()
    import time

    from transformers import AutoTokenizer

    from flows.config import load_config
    from nrl_tasks.algorithms.loss_functions import ClippedPGLossFn
    from nrl_tasks.models.builtin import resolve_model_path
    from nrl_tasks.models.policy.workers.in_process import in_process_worker

    cfg = load_config("configs/grpo_smollm2_vs_trl.yaml", ["policy.model_name=builtin:tiny"] if args.quick else [])
    policy = cfg.policy.model_copy(update={"model_name": resolve_model_path(cfg.policy.model_name)})
    loss_fn = ClippedPGLossFn(cfg.loss_fn.model_dump())
    tokenizer = AutoTokenizer.from_pretrained(policy.model_name)
    variants = [(share, mbs) for mbs in (8, 32) for share in (False, True)]
    times: dict[tuple[bool, int], list[float]] = {v: [] for v in variants}
    results: dict[tuple[bool, int], dict[str, Any]] = {}
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    with in_process_worker(policy) as worker:
        batch = build_batch(worker, tokenizer, chat=not args.quick)
        weights = {k: v.clone() for k, v in worker.model.state_dict().items()}
        optimizer = copy.deepcopy(worker.optimizer.state_dict())
        worker.train(batch, loss_fn, gbs=batch.size, mbs=8)  # warm-up: allocator, optimizer state
        for _ in range(args.repeats):
            for share, mbs in variants:
                worker.model.load_state_dict(weights)
                worker.optimizer.load_state_dict(copy.deepcopy(optimizer))
                worker.cfg = policy.model_copy(update={"share_prompt_prefix": share})
                t0 = time.perf_counter()
                results[(share, mbs)] = worker.train(batch, loss_fn, gbs=batch.size, mbs=mbs)
                times[(share, mbs)].append(time.perf_counter() - t0)
    width = batch["input_ids"].shape[1]
    print(f"\n### policy train, {policy.model_name.rsplit('/', 1)[-1]}: {GROUPS} prompts x {SAMPLES} samples, "
          f"rows of {width} tokens ({int(batch['input_lengths'].sum())} valid), median of {args.repeats}")
    print("| micro-batch | share_prompt_prefix | prompt tokens not rerun / all tokens | train s (median) | all runs | vs off | loss | grad norm |")
    print("|---:|---|---:|---:|---|---:|---:|---:|")
    figures: dict[str, Any] = {}
    for share, mbs in variants:
        median = statistics.median(times[(share, mbs)])
        base = statistics.median(times[(False, mbs)])
        saved, plain = tokens_saved(batch, mbs)
        skipped = saved if share else 0
        r = results[(share, mbs)]
        print(f"| {mbs} | {'on' if share else 'off'} | {skipped} / {plain} | {median:.2f} | "
              f"{' '.join(f'{t:.2f}' for t in times[(share, mbs)])} | {base / median:.2f}x | "
              f"{r['global_loss'][0]:.8f} | {r['grad_norm'][0]:.6f} |")
        figures[f"{'on' if share else 'off'}_mbs{mbs}"] = {"median_s": median, "prompt_tokens_not_rerun": skipped, "runs_s": times[(share, mbs)],
                                                             "loss": r["global_loss"][0], "grad_norm": r["grad_norm"][0]}
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return figures


if __name__ == "__main__":
    main()
