"""Batch store vs torch.save/torch.load on a rollout-shaped batch.

    python -m benchmarks.bench_store [--quick] [--rows N] [--seq S] [--repeats R] [--dir D]

The batch: ``input_ids`` int64 ``[B, S]``, ``logprobs`` / ``prev_logprobs`` float32 ``[B, S]``,
``token_mask`` bool ``[B, S]`` (each row right-padded, lengths uniform in ``[S/2, S]``), per-row
``input_lengths`` int64, ``advantages`` / ``rewards`` / ``sample_mask`` float32, and a list[str]
``prompt`` column. Full: 8192 x 2048 (~290 MB); ``--quick``: 1024 x 2048.

Baselines write/read the same dict with ``torch.save`` and ``torch.load(weights_only=True)``
(default, and ``mmap=True``). ``save_batch`` fsyncs its files (durable commit) while
``torch.save`` does not, so a ``torch.save + fsync`` row is printed too. Files are read back
from the page cache (warm) in both cases; each figure is the best of ``--repeats`` runs.
MB/s counts the batch's tensor bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any, Callable

import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from storage import load_batch, save_batch
from storage.checksum import default_algorithm


def make_batch(rows: int, seq: int, seed: int = 0) -> BatchedDataDict:
    """A GRPO rollout batch (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=g)
    positions = torch.arange(seq)[None, :]
    mask = positions < lengths[:, None]
    ids = torch.randint(0, 50_000, (rows, seq), generator=g) * mask
    logprobs = -torch.rand(rows, seq, generator=g) * mask
    prev = logprobs + 0.01 * torch.randn(rows, seq, generator=g) * mask
    rewards = torch.randint(0, 2, (rows,), generator=g).float()
    words = ["alpha", "beta", "gamma", "delta", "plus", "times", "equals", "seven"]
    prompts = [
        " ".join(words[(i * 7 + j) % len(words)] for j in range(8 + i % 24)) for i in range(rows)
    ]
    return BatchedDataDict(
        {
            "input_ids": ids,
            "logprobs": logprobs,
            "prev_logprobs": prev,
            "token_mask": mask,
            "input_lengths": lengths,
            "advantages": rewards - rewards.mean(),
            "rewards": rewards,
            "sample_mask": torch.ones(rows),
            "prompt": prompts,
        }
    )


def tensor_bytes(batch: BatchedDataDict) -> int:
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


def best_of(repeats: int, fn: Callable[[], Any], setup: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    return min(times)


def _touch(batch: Any) -> None:
    """Read every tensor once so lazily mapped pages count against the load."""
    for v in batch.values():
        if isinstance(v, torch.Tensor):
            v.sum()


def torch_save_fsync(obj: Any, path: str) -> None:
    torch.save(obj, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def run(rows: int, seq: int, repeats: int, workdir: str) -> list[tuple[str, float, float]]:
    batch = make_batch(rows, seq)
    plain = dict(batch.data)
    mb = tensor_bytes(batch) / 1e6
    pt = os.path.join(workdir, "batch.pt")
    ds = os.path.join(workdir, "ds")
    ds4 = os.path.join(workdir, "ds4")
    rows_out: list[tuple[str, float, float]] = []

    def add(name: str, seconds: float) -> None:
        rows_out.append((name, seconds, mb / seconds))
        print(f"  {name:<44} {seconds * 1e3:9.1f} ms {mb / seconds:9.0f} MB/s", flush=True)

    print(f"batch: {rows} rows x {seq} tokens, {mb:.0f} MB of tensors; checksum {default_algorithm()}")
    add("torch.save", best_of(repeats, lambda: torch.save(plain, pt)))
    add("torch.save + fsync", best_of(repeats, lambda: torch_save_fsync(plain, pt)))
    add("save_batch (1 shard, fsync)", best_of(repeats, lambda: save_batch(batch, ds, overwrite=True)))
    add("save_batch (4 shards, fsync)", best_of(repeats, lambda: save_batch(batch, ds4, 4, overwrite=True)))
    add("torch.load(weights_only=True)", best_of(repeats, lambda: torch.load(pt, weights_only=True)))
    add(
        "torch.load(weights_only=True, mmap=True) +touch",
        best_of(repeats, lambda: _touch(torch.load(pt, weights_only=True, mmap=True))),
    )
    add("load_batch (verify=full)", best_of(repeats, lambda: load_batch(ds)))
    add("load_batch (verify=size)", best_of(repeats, lambda: load_batch(ds, verify="size")))
    add("load_batch (verify=size) +touch", best_of(repeats, lambda: _touch(load_batch(ds, verify="size"))))
    add("load_batch (verify=full, 4 shards)", best_of(repeats, lambda: load_batch(ds4)))
    add("load_batch (verify=full, mmap=False)", best_of(repeats, lambda: load_batch(ds, mmap=False)))
    check = load_batch(ds)
    for key, value in plain.items():
        got = check[key]
        same = torch.equal(value, got) if isinstance(value, torch.Tensor) else value == got
        if not same:
            raise SystemExit(f"round trip mismatch in column {key!r}")
    sizes = {
        "torch.save file": os.path.getsize(pt),
        "dataset (1 shard)": sum(e.stat().st_size for e in os.scandir(ds)),
    }
    for name, size in sizes.items():
        print(f"  {name}: {size / 1e6:.1f} MB")
    return rows_out


def ratio(rows: list[tuple[str, float, float]], a: str, b: str) -> float:
    times = {name: seconds for name, seconds, _ in rows}
    return times[b] / times[a]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1024 rows instead of 8192")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    args = parser.parse_args(argv)
    rows = args.rows or (1024 if args.quick else 8192)
    workdir = tempfile.mkdtemp(prefix="bench-store-", dir=args.dir)
    try:
        results = run(rows, args.seq, args.repeats, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n| operation | time (ms) | MB/s |\n|---|---:|---:|")
    for name, seconds, rate in results:
        print(f"| {name} | {seconds * 1e3:.1f} | {rate:.0f} |")
    print("\n| ratio (higher = batch store faster) | value |\n|---|---:|")
    pairs = [
        ("save_batch (1 shard, fsync)", "torch.save", "save vs torch.save"),
        ("save_batch (1 shard, fsync)", "torch.save + fsync", "save vs torch.save + fsync"),
        ("load_batch (verify=full)", "torch.load(weights_only=True)", "load (full verify) vs torch.load"),
        ("load_batch (verify=size)", "torch.load(weights_only=True)", "load (size verify) vs torch.load"),
        (
            "load_batch (verify=size) +touch",
            "torch.load(weights_only=True, mmap=True) +touch",
            "load+touch vs torch.load(mmap)+touch",
        ),
    ]
    for ours, theirs, label in pairs:
        print(f"| {label} | {ratio(results, ours, theirs):.2f}x |")


if __name__ == "__main__":
    main()
