"""Refit throughput: per-tensor vs packed vs flat broadcasts between two processes over gloo.

Run: ``python -m benchmarks.bench_refit [--quick] [--buffer-mib N] [--repeats R] [--sweep [MIB ...]]``.

A transformer-shaped parameter set (Qwen-like: GQA attention with biases, gated MLP, RMSNorm
weights in float32, everything else bfloat16; ~290 tensors and ~520 MB; ``--quick`` ~100 MB)
goes from rank 0 to rank 1 over a stateless gloo group on 127.0.0.1:

(a) ``per-tensor``: one synchronous broadcast per tensor, received in place (no copies);
(b) ``packed x1``: ``packed_broadcast_producer``/``consumer`` with one buffer;
(c) ``packed x2``: the same with two alternating buffers (pack/unpack overlap the wire);
(d) ``flat``: one broadcast of a single tensor holding the same bytes (transport ceiling);
(e) ``zero-copy``: parameters are views into ``FlatParamBuckets`` on both sides; the buckets
    themselves are broadcast, two in flight.

The consumer of (b)/(c) copies every received tensor into its own preallocated parameters, as
a generation worker loading weights does. Every mode is checked bit-exact with a checksum.
Timings are the slower of the two ranks; after one warm-up (and checksum) pass per mode, the
modes are timed in interleaved rounds (so they share the machine's load alike); the table
shows the best and the median round.

With CUDA (``torch.cuda.is_available()``) it instead measures, in one process on one device,
the packing overhead: per-tensor / packed / flat through a loopback group whose "wire" is one
device-to-device copy per broadcast (two processes may not share one GPU under NCCL).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from nrl_tasks.utils.collective import create_broadcast_group, find_free_port
from nrl_tasks.utils.packed_tensor import (
    FlatParamBuckets,
    get_target_packed_tensor_size,
    packed_broadcast_consumer,
    packed_broadcast_producer,
)
from nrl_tasks.utils.refit import weights_checksum

Spec = list[tuple[str, tuple[int, ...], torch.dtype]]
MiB = 1024 * 1024


def small_spec(quick: bool) -> Spec:
    """Many small tensors (2000 x 128 KiB, 500 with --quick): where per-call latency dominates."""
    count = 500 if quick else 2000
    return [(f"small.{i}.weight", (256, 128), torch.float32) for i in range(count)]


def make_spec(args: dict[str, Any]) -> Spec:
    return small_spec(args["quick"]) if args["tensor_set"] == "small" else transformer_spec(args["quick"])


def transformer_spec(quick: bool) -> Spec:
    """Qwen-like shapes: 24 layers (5 with --quick), hidden 896, GQA 14/2 heads, MLP 2432."""
    layers, hidden, inter, kv, vocab = (5, 896, 2432, 128, 8000) if quick else (24, 896, 2432, 128, 32000)
    bf16, fp32 = torch.bfloat16, torch.float32
    spec: Spec = [("model.embed_tokens.weight", (vocab, hidden), bf16)]
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [
            (p + "input_layernorm.weight", (hidden,), fp32),
            (p + "self_attn.q_proj.weight", (hidden, hidden), bf16),
            (p + "self_attn.q_proj.bias", (hidden,), bf16),
            (p + "self_attn.k_proj.weight", (kv, hidden), bf16),
            (p + "self_attn.k_proj.bias", (kv,), bf16),
            (p + "self_attn.v_proj.weight", (kv, hidden), bf16),
            (p + "self_attn.v_proj.bias", (kv,), bf16),
            (p + "self_attn.o_proj.weight", (hidden, hidden), bf16),
            (p + "post_attention_layernorm.weight", (hidden,), fp32),
            (p + "mlp.gate_proj.weight", (inter, hidden), bf16),
            (p + "mlp.up_proj.weight", (inter, hidden), bf16),
            (p + "mlp.down_proj.weight", (hidden, inter), bf16),
        ]
    spec += [("model.norm.weight", (hidden,), fp32), ("lm_head.weight", (vocab, hidden), bf16)]
    return spec


def spec_bytes(spec: Spec) -> int:
    total = 0
    for _, shape, dtype in spec:
        n = 1
        for d in shape:
            n *= d
        total += n * dtype.itemsize
    return total


def make_params(spec: Spec, seed: int | None) -> dict[str, torch.Tensor]:
    """Tensors of ``spec``; random bytes when ``seed`` is given, else uninitialised (but touched)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out = {}
    for name, shape, dtype in spec:
        t = torch.empty(shape, dtype=dtype)
        raw = t.view(-1).view(torch.uint8)
        if gen is not None:
            raw.random_(0, 256, generator=gen)
        else:
            raw.zero_()
        out[name] = t
    return out


def _timed(group: Any, fn: Callable[[], None]) -> float:
    group.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _worker(rank: int, port: int, args: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(1)
    spec = make_spec(args)
    target = args["buffer_bytes"]
    group = create_broadcast_group("127.0.0.1", port, rank, 2, timeout_s=300.0)
    params = make_params(spec, seed=0 if rank == 0 else None)
    names = [n for n, _, _ in spec]
    meta = [(n, (s, d)) for n, s, d in spec]
    total = spec_bytes(spec)
    flat = torch.empty(total, dtype=torch.uint8)
    flat.zero_()
    buckets = FlatParamBuckets(spec, target)
    if rank == 0:
        buckets.copy_from(params.items())

    def per_tensor() -> None:
        for n in names:
            group.broadcast(params[n].view(-1).view(torch.uint8), 0)

    staging = torch.zeros(max(params[n].numel() * params[n].element_size() for n in names), dtype=torch.uint8)

    def per_tensor_load() -> None:
        for n in names:
            raw = params[n].view(-1).view(torch.uint8)
            if rank == 0:
                group.broadcast(raw, 0)
            else:  # like a worker without packing: receive into a staging tensor, then load it
                group.broadcast(staging[: raw.numel()], 0)
                raw.copy_(staging[: raw.numel()])

    def packed(count: int, size: int) -> Callable[[], None]:
        def run() -> None:
            if rank == 0:
                packed_broadcast_producer(iter(params.items()), group, 0, lambda item: item[1],
                                          buffer_size_bytes=size, num_buffers=count)
            else:
                def load(batch: list[tuple[str, torch.Tensor]]) -> None:
                    for n, t in batch:
                        params[n].copy_(t)
                # load() copies every tensor out at once: reuse the buffers
                packed_broadcast_consumer(iter(meta), group, 0, load, buffer_size_bytes=size, num_buffers=count,
                                          reuse_buffers=True)
        return run

    def flat_one() -> None:
        group.broadcast(flat, 0)

    def zero_copy() -> None:
        buckets.broadcast(group, 0, num_buffers=2)

    modes: list[tuple[str, Callable[[], None], Callable[[], str]]] = []
    checksum_params = lambda: weights_checksum(params.items())  # noqa: E731
    modes.append(("per-tensor, in place", per_tensor, checksum_params))
    modes.append(("per-tensor + load copy", per_tensor_load, checksum_params))
    if args["sweep"]:
        for mib in args["sweep"]:
            modes.append((f"packed x2 {mib} MiB", packed(2, mib * MiB), checksum_params))
    else:
        modes.append(("packed x1", packed(1, target), checksum_params))
        modes.append(("packed x2", packed(2, target), checksum_params))
    modes.append(("flat (ceiling)", flat_one, lambda: weights_checksum([("flat", flat)])))
    modes.append(("zero-copy buckets", zero_copy, lambda: weights_checksum(buckets.named_tensors())))

    if rank == 0:
        offset = 0  # flat holds the same bytes as the parameters
        for n in names:
            raw = params[n].view(-1).view(torch.uint8)
            flat[offset : offset + raw.numel()].copy_(raw)
            offset += raw.numel()

    def wipe() -> None:  # on the receiver, so that a broken mode cannot pass on stale bytes
        if rank == 1:
            for t in params.values():
                t.view(-1).view(torch.uint8).zero_()
            flat.zero_()
            for _, t in buckets.named_tensors():
                t.view(-1).view(torch.uint8).zero_()

    # Warm-up and correctness pass, then timed rounds that interleave the modes, so that every
    # mode sees the same (shared, noisy) machine load.
    checksums = {}
    for label, fn, checksum in modes:
        wipe()
        _timed(group, fn)
        checksums[label] = checksum()
    times: dict[str, list[float]] = {label: [] for label, _, _ in modes}
    for _ in range(args["repeats"]):
        for label, fn, _ in modes:
            times[label].append(_timed(group, fn))
    for label, _, _ in modes:
        results.put((rank, label, times[label], checksums[label], total))
    group.barrier()
    group.close()


def _load() -> str:
    try:
        return "load avg " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "load avg n/a"


def run_gloo(args: dict[str, Any]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, args, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    rows: dict[str, dict[str, Any]] = {}
    expected = None
    try:
        while any(p.is_alive() for p in procs) or not results.empty():
            try:
                rank, label, times, checksum, total = results.get(timeout=1.0)
            except Exception:
                continue
            row = rows.setdefault(label, {"mode": label, "bytes": total, "times": {}, "checksums": {}})
            row["times"][rank] = times
            row["checksums"][rank] = checksum
    finally:
        for p in procs:
            p.join(timeout=60)
    for p in procs:
        if p.exitcode != 0:
            raise SystemExit(f"benchmark worker exited with code {p.exitcode}")
    out = []
    for row in rows.values():
        per_run = [max(a, b) for a, b in zip(row["times"][0], row["times"][1])]
        ok = row["checksums"][0] == row["checksums"][1]
        expected = expected or row["checksums"][0]
        out.append({"mode": row["mode"], "bytes": row["bytes"], "best_s": min(per_run),
                    "median_s": statistics.median(per_run), "bit_exact": ok})
    return out


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    base = next(r for r in rows if r["mode"].startswith("per-tensor"))  # the in-place one: the stricter baseline
    ceil = next((r for r in rows if r["mode"].startswith("flat")), None)
    print(f"\n### {title}\n")
    print("| mode | GB/s (best) | GB/s (median) | vs per-tensor | vs flat ceiling | bit-exact |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        gbs = r["bytes"] / r["best_s"] / 1e9
        med = r["bytes"] / r["median_s"] / 1e9
        vs_base = base["best_s"] / r["best_s"]
        vs_ceil = f"{ceil['best_s'] / r['best_s']:.2f}" if ceil else "-"
        print(f"| {r['mode']} | {gbs:.2f} | {med:.2f} | {vs_base:.2f}x | {vs_ceil} | {'yes' if r['bit_exact'] else 'NO'} |")


# ----------------------------------------------------------------------------------------------
# One CUDA device: loopback (packing overhead only; no second process)


class _CudaLoopback:
    """A 'group' whose wire is a device-to-device copy: send appends, receive pops in order."""

    def __init__(self) -> None:
        self.queue: list[torch.Tensor] = []
        self.sending = True
        self.device = torch.device("cuda", torch.cuda.current_device())  # where receive buffers go

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.sending:
            self.queue.append(tensor.clone())
        else:
            tensor.copy_(self.queue.pop(0))


def run_cuda(args: dict[str, Any]) -> list[dict[str, Any]]:
    spec = make_spec(args)
    total = spec_bytes(spec)
    params = {n: t.cuda() for n, t in make_params(spec, seed=0).items()}
    dest = {n: torch.empty_like(t) for n, t in params.items()}
    meta = [(n, (s, d)) for n, s, d in spec]
    target = args["buffer_bytes"]
    rows = []

    def measure(label: str, send: Callable[[_CudaLoopback], None], recv: Callable[[_CudaLoopback], None]) -> None:
        times = []
        for _ in range(args["repeats"] + 1):
            loop = _CudaLoopback()
            torch.cuda.synchronize()
            start = time.perf_counter()
            send(loop)
            loop.sending = False
            recv(loop)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        same = all(torch.equal(params[n].view(-1).view(torch.uint8), dest[n].view(-1).view(torch.uint8)) for n in params) \
            if not label.startswith("flat") else True
        rows.append({"mode": label, "bytes": total, "best_s": min(times[1:]), "median_s": statistics.median(times[1:]),
                     "bit_exact": same})
        for t in dest.values():
            t.zero_()

    def per_send(loop: _CudaLoopback) -> None:
        for t in params.values():
            loop.broadcast(t.view(-1).view(torch.uint8), 0)

    def per_recv(loop: _CudaLoopback) -> None:
        for t in dest.values():
            loop.broadcast(t.view(-1).view(torch.uint8), 0)

    def packed_pair(count: int) -> tuple[Callable[[_CudaLoopback], None], Callable[[_CudaLoopback], None]]:
        def send(loop: _CudaLoopback) -> None:
            packed_broadcast_producer(iter(params.items()), loop, 0, lambda it: it[1], buffer_size_bytes=target, num_buffers=count)

        def recv(loop: _CudaLoopback) -> None:
            def load(batch: list[tuple[str, torch.Tensor]]) -> None:
                for n, t in batch:
                    dest[n].copy_(t)
            # load() copies every tensor out at once: reuse the buffers
            packed_broadcast_consumer(iter(meta), loop, 0, load, buffer_size_bytes=target, num_buffers=count,
                                      reuse_buffers=True)
        return send, recv

    flat_src = torch.empty(total, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    measure("per-tensor, in place", per_send, per_recv)
    measure("packed x1", *packed_pair(1))
    measure("packed x2", *packed_pair(2))
    measure("flat (ceiling)", lambda loop: loop.broadcast(flat_src, 0), lambda loop: loop.broadcast(flat_dst, 0))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~100 MB instead of ~520 MB")
    parser.add_argument("--buffer-mib", type=int, default=None, help="packed target (default: get_target_packed_tensor_size())")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per mode (default 3, --quick 2)")
    parser.add_argument("--sweep", nargs="*", type=int, default=None, metavar="MIB",
                        help="packed x2 over these targets in MiB (default 1 2 4 8 16 32 64) instead of (b)/(c)")
    parser.add_argument("--tensor-set", choices=["transformer", "small"], default="transformer",
                        help="transformer-shaped set (default) or 2000 x 128 KiB tensors")
    parser.add_argument("--gloo", action="store_true", help="force the two-process gloo benchmark even with CUDA")
    ns = parser.parse_args(argv)
    target = ns.buffer_mib * MiB if ns.buffer_mib else get_target_packed_tensor_size()
    args = {"quick": ns.quick, "buffer_bytes": target, "repeats": ns.repeats or (2 if ns.quick else 3), "sweep": (ns.sweep or [1, 2, 4, 8, 16, 32, 64]) if ns.sweep is not None else None,
            "tensor_set": ns.tensor_set}
    spec = make_spec(args)
    print(f"refit benchmark: {len(spec)} tensors, {spec_bytes(spec) / 1e6:.0f} MB, packed target {target / MiB:.0f} MiB, "
          f"{args['repeats']} timed runs per mode, {os.cpu_count()} CPUs, {_load()}")
    if torch.cuda.is_available() and not ns.gloo:
        rows = run_cuda(args)
        print_table(rows, f"one CUDA device, loopback ({torch.cuda.get_device_name()})")
    else:
        rows = run_gloo(args)
        print_table(rows, "gloo, 2 processes on 127.0.0.1")
    print(f"\n{_load()} at the end")


if __name__ == "__main__":
    main()
