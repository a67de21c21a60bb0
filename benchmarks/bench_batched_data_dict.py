"""Benchmark BatchedDataDict sharding: plain vs dynamic batching vs sequence packing.

Run from the repo root: ``python -m benchmarks.bench_batched_data_dict [--quick]``.

Data: ``rows`` rollouts (default 16384; 2048 with ``--quick``) with lengths uniform in
[64, 2048] tokens, right-padded ``input_ids`` [rows, 2048] int64, 8 shards, global batches of
``rows // 4``. Prints rows/s of ``shard_by_batch_size`` per mode, padding efficiency (real
tokens / tokens computed) of dynamic batching vs fixed micro-batches, and the token balance of
packed bins across shards for token-balanced vs round-robin (NeMo-RL) dealing, on these lengths
and on small global batches with long-tailed lengths (where round-robin breaks down).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.distributed.sequence_packing import padded_length, plan_packed_shards

WIDTH = 2048


def make_batch(rows: int, seed: int) -> BatchedDataDict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, WIDTH + 1, (rows,), generator=gen)
    ids = torch.randint(1, 32000, (rows, WIDTH), generator=gen)
    ids.masked_fill_(torch.arange(WIDTH)[None, :] >= lengths[:, None], 0)
    return BatchedDataDict({"input_ids": ids, "input_lengths": lengths,
                            "advantages": torch.randn(rows, generator=gen),
                            "sample_id": list(range(rows))})


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def fixed_padding(lengths: list[int], shards: list[list[int]], mbs: int, round_to: int) -> tuple[int, int]:
    """Tokens computed by fixed micro-batches of ``mbs`` rows: (padded to batch width, to mb max)."""
    to_width = to_longest = 0
    for rows in shards:
        for i in range(0, len(rows), mbs):
            mb = rows[i : i + mbs]
            to_width += len(mb) * WIDTH
            to_longest += len(mb) * min(padded_length(max(lengths[r] for r in mb), round_to), WIDTH)
    return to_width, to_longest


DEALINGS = {  # name: (balance, equalize)
    "round-robin (NeMo-RL)": (False, False),
    "token-balanced dealing": (True, False),
    "equalized bins + token-balanced (default)": (True, True),
}


def balance(lengths: list[int], shards: int, gbs: int, capacity: int, algorithm: str,
            dealing: str) -> dict[str, float]:
    """Per-shard packed tokens and lock-step cost: ranks run bin k together, so each step costs
    the largest k-th bin over shards; reported relative to total tokens / shards."""
    balanced, equalized = DEALINGS[dealing]
    _, plans = plan_packed_shards(lengths, shards, gbs, capacity, algorithm,
                                  balance=balanced, equalize=equalized)
    loads = [sum(t for gb in plan[1] for t in gb) for plan in plans]
    lockstep, worst_gb = 0, 1.0
    for g in range(len(plans[0][1])):
        lockstep += sum(max(step) for step in zip(*(plan[1][g] for plan in plans)))
        gb_loads = [sum(plan[1][g]) for plan in plans]
        worst_gb = max(worst_gb, max(gb_loads) / min(gb_loads))
    ideal = sum(loads) / shards
    return {"max_min": max(loads) / min(loads), "worst_gb": worst_gb,
            "lockstep": lockstep / ideal, "bins": sum(len(gb) for gb in plans[0][1]) * shards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2048 rows, one repeat")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16384, help="tokens per micro-batch / bin")
    parser.add_argument("--round", type=int, default=64, help="sequence_length_round / pad multiple")
    parser.add_argument("--small-bins", type=int, default=3072,
                        help="second packing capacity, below 2x the longest row (MFFD != FFD)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = args.rows or (2048 if args.quick else 16384)
    repeats = 1 if args.quick else 3
    shards, gbs = args.shards, rows // 4
    torch.set_num_threads(1)
    batch = make_batch(rows, args.seed)
    lengths = batch["input_lengths"].tolist()
    real = sum(lengths)
    dyn_cfg = dict(max_tokens_per_microbatch=args.max_tokens, sequence_length_round=args.round,
                   input_key="input_ids", input_lengths_key="input_lengths")

    def pack_cfg(algorithm: str) -> dict:
        return dict(max_tokens_per_microbatch=args.max_tokens, input_key="input_ids",
                    input_lengths_key="input_lengths", algorithm=algorithm,
                    sequence_length_pad_multiple=args.round)

    print(f"rows={rows} width={WIDTH} shards={shards} global_batch={gbs} "
          f"max_tokens={args.max_tokens} round={args.round} real_tokens={real}")
    results: list[tuple[str, float]] = []
    t_plain, _ = timed(lambda: batch.shard_by_batch_size(shards, batch_size=gbs), repeats)
    results.append(("plain shard_by_batch_size (baseline)", t_plain))
    t_dyn, (dyn_shards, dyn_idx) = timed(
        lambda: batch.shard_by_batch_size(shards, batch_size=gbs, dynamic_batching_cfg=dyn_cfg), repeats)
    results.append(("dynamic batching", t_dyn))
    packed = {}
    for algorithm in ("first_fit_decreasing", "modified_first_fit_decreasing"):
        t, out = timed(lambda: batch.shard_by_batch_size(
            shards, batch_size=gbs, sequence_packing_cfg=pack_cfg(algorithm)), repeats)
        results.append((f"sequence packing {algorithm}", t))
        packed[algorithm] = out

    restored = BatchedDataDict.from_batches(dyn_shards)
    restored.reorder_data(dyn_idx)
    if restored["sample_id"] != list(range(rows)):
        raise SystemExit("dynamic batching indices did not restore the order")

    dyn_tokens = sum((e - s) * n for shard in dyn_shards for s, e, n in shard._plan("dynamic"))
    dyn_mbs = dyn_shards[0].get_microbatch_iterator_dynamic_shapes_len()
    fixed_mbs = max(1, args.max_tokens // WIDTH)
    plain_rows = [[g * gbs + j for g in range(rows // gbs)
                   for j in range(s * gbs // shards, (s + 1) * gbs // shards)] for s in range(shards)]
    to_width, to_longest = fixed_padding(lengths, plain_rows, fixed_mbs, args.round)
    padding = [
        (f"fixed micro-batches of {fixed_mbs}, padded to width {WIDTH}", to_width, rows // shards // fixed_mbs),
        (f"fixed micro-batches of {fixed_mbs}, padded to longest row", to_longest, rows // shards // fixed_mbs),
        ("dynamic batching", dyn_tokens, dyn_mbs),
    ]
    for algorithm, (shards_out, _) in packed.items():
        bins, _ = shards_out[0].get_microbatch_iterator_for_packable_sequences_len()
        tokens = sum(t for s in shards_out for gb in s.micro_batch_lengths for t in gb)
        padding.append((f"packing {algorithm} (row padding only)", tokens, bins))
        padding.append((f"packing {algorithm} (bins padded to capacity)", bins * shards * args.max_tokens, bins))

    padded_lengths = [padded_length(n, args.round) for n in lengths]
    dealing = [("uniform", gbs, alg, cap, how, balance(padded_lengths, shards, gbs, cap, alg, how))
               for cap in (args.max_tokens, args.small_bins) for alg in packed for how in DEALINGS]
    # GRPO-like small global batches with a long tail: where round-robin dealing breaks down
    gen = torch.Generator().manual_seed(args.seed + 1)
    tail_rows, tail_gbs = 16 * 64, 64
    short = torch.randint(64, 257, (tail_rows,), generator=gen)
    long = torch.randint(1500, WIDTH + 1, (tail_rows,), generator=gen)
    tailed = torch.where(torch.rand(tail_rows, generator=gen) < 0.1, long, short).tolist()
    tailed = [padded_length(n, args.round) for n in tailed]
    dealing += [("long tail", tail_gbs, alg, 8192, how, balance(tailed, shards, tail_gbs, 8192, alg, how))
                for alg in packed for how in DEALINGS]

    print("\n## Sharding throughput\n")
    print("| mode | seconds | rows/s | vs plain |")
    print("|---|---:|---:|---:|")
    for name, t in results:
        print(f"| {name} | {t:.3f} | {rows / t:,.0f} | {t / t_plain:.2f}x |")
    print("\n## Padding efficiency (real tokens / tokens computed)\n")
    print("| micro-batching | micro-batches per shard | tokens computed | efficiency |")
    print("|---|---:|---:|---:|")
    for name, tokens, mbs in padding:
        print(f"| {name} | {mbs} | {tokens:,} | {real / tokens:.1%} |")
    print("\n## Packed tokens per shard\n")
    print("max/min: tokens of the heaviest over the lightest shard, in the worst global batch and")
    print("over the whole batch; lock-step: sum over micro-batch steps of the largest bin any rank")
    print("runs at that step, over total tokens / shards (1.0 = no rank ever waits).\n")
    print("Lengths: 'uniform' as above; 'long tail': 1024 rows, 90% 64-256 and 10% 1500-2048 tokens.\n")
    print("| lengths | global batch | algorithm | capacity | dealing | bins | max/min (worst global batch) "
          "| max/min (whole batch) | lock-step cost / ideal |")
    print("|---|---:|---|---:|---|---:|---:|---:|---:|")
    for lens, gb, alg, cap, how, m in dealing:
        print(f"| {lens} | {gb} | {alg} | {cap} | {how} | {m['bins']} | {m['worst_gb']:.3f} "
              f"| {m['max_min']:.3f} | {m['lockstep']:.3f} |")


if __name__ == "__main__":
    main()
