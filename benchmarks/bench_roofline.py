"""How far each stage of a SmolLM2 step is from what this machine allows (issue 45, item 3).

    python -m benchmarks.bench_roofline [--quick] [--threads 2] [--model builtin:smollm2] [--repeats 3]

**The bounds**, measured here with torch and the same intra-op threads as the workers:
- fp32 matmul FLOP/s: the best of square 2048 products and the products a SmolLM2 layer makes
  (2,048 token rows against its 576 x 1536 MLP and 576 x 49152 head); the same with a decode
  step's 32 rows are printed too (how much of the peak a narrow product can reach);
- memory bandwidth: a sum over a 512 MB float32 tensor (bytes read per second) and a copy of it
  (bytes read + written per second); the larger is the bound.

**The stages**, on the policy worker's own calls in this process (no Ray: ``bench_actor`` measures
what the actor adds), on the batch of ``bench_actor``: 8 prompts x 4 samples, 48 prompt and 4..16
completion tokens, ``configs/grpo_smollm2_vs_trl.yaml``'s policy (float32, prompt sharing on):
- ``get_logprobs``: 2 N T FLOPs; ``train`` (forward, backward, AdamW): 6 N T FLOPs, where N counts
  every parameter once (the tied embedding is the LM head's matmul) and T is the tokens that must
  be computed: each shared prompt once plus every completion token (the batch's rows hold more:
  both are printed);
- ``generate`` (16 new tokens a row, EOS ignored): each decode step reads every weight once
  (4 N bytes) and makes 2 N FLOPs a row; the prefill is 2 N FLOPs a token of each distinct prompt
  (the decode loop prefills a shared prompt once).

A stage's **bound** is the roofline time, the larger of FLOPs / matmul peak and bytes / bandwidth;
its **fraction** is bound / measured seconds (1.0 is the machine's limit). Not part of CI.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from benchmarks._common import best_of, quiet_env


def _best(fn, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up."""
    fn()
    return best_of(fn, repeats)[0]


def prompt_length(batch: Any) -> int:
    """The prompts' length in ``bench_actor``'s batch: where ``token_mask`` first turns on."""
    from nrl_tasks.models.policy.workers.prefix_sharing import prefix_lengths_from_mask

    return int(prefix_lengths_from_mask(batch["token_mask"], batch["input_lengths"]).min())


def matmul_peak(repeats: int, quick: bool) -> tuple[float, list[tuple[str, float]]]:
    """``(best FLOP/s, [(shape, FLOP/s)])`` of fp32 matmuls."""
    shapes = [(512, 512, 512), (32, 512, 512)] if quick else [
        (2048, 2048, 2048), (2048, 576, 1536), (2048, 1536, 576), (2048, 576, 49152),
        (32, 576, 1536), (32, 576, 49152)]  # the last two: a decode step's 32 rows
    rows = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        s = _best(lambda: torch.mm(a, b, out=out), repeats)
        rows.append((f"{m}x{k} @ {k}x{n}", 2 * m * k * n / s))
    return max(f for _, f in rows), rows


def work(batch: Any, n_params: int, new_tokens: int, samples: int) -> dict[str, dict[str, float]]:
    """Model FLOPs and bytes of each stage on ``batch`` (see the module docstring)."""
    lengths = batch["input_lengths"]
    prompt_len = prompt_length(batch)
    rows = int(batch.size)
    prompts = rows // samples
    completions = int(lengths.sum()) - rows * prompt_len
    t_unique = prompts * prompt_len + completions
    weight_bytes = 4 * n_params
    decode_steps = new_tokens - 1  # the prefill makes the first token
    return {
        "get_logprobs": {"flops": 2 * n_params * t_unique, "bytes": weight_bytes, "tokens": t_unique},
        # weights read by the forward and the backward (twice), AdamW's reads and writes (7 passes)
        "train": {"flops": 6 * n_params * t_unique, "bytes": 10 * weight_bytes, "tokens": t_unique},
        # the decode loop prefills each distinct prompt once
        "generate": {"flops": 2 * n_params * (prompts * prompt_len + rows * decode_steps),
                     "bytes": weight_bytes * (1 + decode_steps), "tokens": rows * new_tokens},
    }


def bandwidth(repeats: int, quick: bool) -> dict[str, float]:
    """Bytes per second of a read-only sum and of a copy over a tensor far larger than the caches."""
    n = (32 if quick else 512) * 2**20 // 4
    x, y = torch.ones(n), torch.empty(n)
    read = _best(lambda: x.sum(), repeats)
    copy = _best(lambda: y.copy_(x), repeats)
    return {"read": 4 * n / read, "copy": 2 * 4 * n / copy, "mb": 4 * n / 2**20}


def stage_times(pc: Any, batch: Any, repeats: int) -> dict[str, float]:
    """Best seconds of the worker's ``get_logprobs``, ``train`` and ``generate`` on ``batch``."""
    from nrl_tasks.algorithms.loss_functions import NLLLossFn
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
    from nrl_tasks.models.policy.workers.in_process import in_process_worker

    prompt_len = prompt_length(batch)
    prompts = BatchedDataDict({
        "input_ids": batch["input_ids"][:, :prompt_len].contiguous(),
        "input_lengths": torch.full((batch.size,), prompt_len),
        "seeds": torch.arange(batch.size),
    })
    loss_fn = NLLLossFn()
    with in_process_worker(pc) as worker:
        return {
            "get_logprobs": _best(lambda: worker.get_logprobs(batch), repeats),
            "train": _best(lambda: worker.train(batch, loss_fn), repeats),
            "generate": _best(lambda: worker.generate(prompts), repeats),
        }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny built-in model and small bounds: a smoke run")
    parser.add_argument("--model", default="builtin:smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    quiet_env()
    from transformers import AutoTokenizer

    from benchmarks.bench_actor import make_batch
    from flows.config import load_config
    from nrl_tasks.models.builtin import resolve_model_path

    model = "builtin:tiny" if args.quick else args.model
    new_tokens = 16
    cfg = load_config("configs/grpo_smollm2_vs_trl.yaml", overrides=[
        f"policy.model_name={model}", f"policy.torch_num_threads={args.threads}",
        f"generation.max_new_tokens={new_tokens}", "generation.ignore_eos=true"])
    pc = cfg.policy_config()
    tok = AutoTokenizer.from_pretrained(resolve_model_path(model))
    batch = make_batch(len(tok), new=new_tokens)
    load0 = os.getloadavg()[0]

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        peak, mm_rows = matmul_peak(args.repeats, args.quick)
        bw = bandwidth(args.repeats, args.quick)
    finally:
        torch.set_num_threads(threads)
    times = stage_times(pc, batch, args.repeats)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(resolve_model_path(model))).parameters())
    stages = work(batch, n_params, new_tokens, samples=4)

    print(f"model {model}: {n_params / 1e6:.1f} M parameters, {4 * n_params / 1e6:.0f} MB of float32 weights; "
          f"batch {batch.size} rows, {int(batch['input_lengths'].sum())} row tokens, "
          f"{stages['train']['tokens']} to compute; {args.threads} threads; load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    print("\n| bound (this machine, torch, same threads) | figure |")
    print("|---|---:|")
    for shape, f in mm_rows:
        print(f"| fp32 matmul {shape} | {f / 1e9:.1f} GFLOP/s |")
    print(f"| **matmul peak** (best of the above) | **{peak / 1e9:.1f} GFLOP/s** |")
    moved = max(bw["read"], bw["copy"])
    print(f"| memory bandwidth, read (sum of {bw['mb']:.0f} MB) | {bw['read'] / 1e9:.2f} GB/s |")
    print(f"| memory bandwidth, copy (read + write of {bw['mb']:.0f} MB) | {bw['copy'] / 1e9:.2f} GB/s |")
    print(f"| **memory bandwidth** (the larger) | **{moved / 1e9:.2f} GB/s** |")
    print(f"| ridge point (FLOPs per byte) | {peak / moved:.1f} |")

    print("\n| stage | measured s | model GFLOP | GFLOP/s | of matmul peak | weight GB read | GB/s | of bandwidth | roofline bound s | fraction of the bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    worst = ("", 2.0)
    figures: dict[str, Any] = {"peak_flops": peak, "bandwidth": moved, "stages": {}}
    for name, s in times.items():
        w = stages[name]
        bound = max(w["flops"] / peak, w["bytes"] / moved)
        frac = bound / s
        worst = min(worst, (name, frac), key=lambda t: t[1])
        figures["stages"][name] = {"s": s, **w, "bound_s": bound, "fraction": frac}
        print(f"| {name} | {s:.3f} | {w['flops'] / 1e9:.1f} | {w['flops'] / s / 1e9:.1f} | {w['flops'] / s / peak:.0%} "
              f"| {w['bytes'] / 1e9:.2f} | {w['bytes'] / s / 1e9:.2f} | {w['bytes'] / s / moved:.0%} | {bound:.3f} | {frac:.2f} |")
    print(f"\nworst fraction: {worst[0]} at {worst[1]:.2f} of its bound")
    rates = dict(mm_rows)
    if not args.quick:  # a decode step multiplies 32 rows: bound it by what such products reach here
        mc = AutoConfig.from_pretrained(resolve_model_path(model))
        head = mc.vocab_size * mc.hidden_size
        decode_tokens = batch.size * (new_tokens - 1)
        prefill_tokens = stages["generate"]["flops"] / (2 * n_params) - decode_tokens
        narrow = (prefill_tokens * 2 * n_params / peak
                  + decode_tokens * (2 * (n_params - head) / rates["32x576 @ 576x1536"] + 2 * head / rates["32x576 @ 576x49152"]))
        print(f"generate against the 32-row products' rates (body {rates['32x576 @ 576x1536'] / 1e9:.0f}, "
              f"LM head {rates['32x576 @ 576x49152'] / 1e9:.0f} GFLOP/s): bound {narrow:.3f} s, "
              f"fraction {narrow / times['generate']:.2f}")
    return figures


if __name__ == "__main__":
    main()
