"""Packed broadcast checks of ``benchmarks.gpu_check``: in one process, over a loopback group.

:class:`LoopbackGroup` is a "group" with a synchronous ``broadcast(tensor, src)`` (the kind
``nrl_tasks.utils.collective.start_broadcast`` accepts for vLLM's communicator): while sending it
queues a copy of every broadcast, then the receiving end pops them in order into its own
tensors. Its wire is one device copy per broadcast, so its GB/s figures measure the packing
machinery (pack and unpack copies, alternating buffers and, on CUDA, side streams), not a link.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._gpu_check_report import Row, best_time, gbps, sync, verdict
from nrl_tasks.utils.packed_tensor import packed_broadcast_consumer, packed_broadcast_producer

Spec = list[tuple[str, tuple[int, ...], torch.dtype]]
Named = dict[str, torch.Tensor]

#: Dtypes of the bit-exact round trip (float8 where this torch has it).
ROUND_TRIP_DTYPES: tuple[torch.dtype, ...] = tuple(
    d
    for d in (
        torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, getattr(torch, "float8_e4m3fn", None),
    )
    if d is not None
)
ROUND_TRIP_BUFFER = 64 * 1024  # small, so the tensors below cross many chunk boundaries


class LoopbackGroup:
    """Both ends of a broadcast in one process (see the module docstring); ``device`` is where
    the receiving end's buffers live (read by ``group_device``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sending = True
        self._wire: deque[torch.Tensor] = deque()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.sending:
            self._wire.append(tensor.clone())  # on the caller's (side) stream, after its copies
            return
        sent = self._wire.popleft()
        tensor.copy_(sent)
        if sent.is_cuda:  # read on this stream: keep the block from being reused before the copy ran
            sent.record_stream(torch.cuda.current_stream(sent.device))

    def receive(self) -> None:
        """Switch to the receiving end (after the producer returned)."""
        self.sending = False

    def pending(self) -> int:
        return len(self._wire)


def fill_random(tensor: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random bytes into ``tensor`` (random 0/1 for bool); returns it."""
    if tensor.dtype == torch.bool:
        return tensor.copy_(torch.randint(0, 2, tensor.shape, generator=gen, dtype=torch.bool))
    raw = tensor.view(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    raw[:whole].view(torch.int64).random_(generator=gen)  # 8 bytes per draw: fast for large sets
    raw[whole:].random_(0, 256, generator=gen)
    return tensor


def random_tensors(spec: Spec, seed: int, device: torch.device) -> Named:
    """Contiguous tensors of ``spec`` with random bytes (same seed, same bytes, any process)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: fill_random(torch.empty(shape, dtype=dtype), gen).to(device) for name, shape, dtype in spec}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of shape, dtype and bytes (NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().contiguous(), b.detach().to(a.device).contiguous()
    return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def mismatches(sent: Named, received: Named) -> list[str]:
    """Names missing, extra or not bit-identical on the receiving side."""
    bad = sorted(set(sent) ^ set(received))
    return bad + [n for n in sent if n in received and not same_bytes(sent[n], received[n])]


def transformer_spec(gpu: bool) -> Spec:
    """Llama-shaped bf16 parameters with fp32 norms: ~0.98 GB (8 layers, hidden 2048, GQA
    16/4 heads, MLP 5632, vocab 32000) on GPU; ~5 MB (2 layers, hidden 256) on CPU."""
    layers, hidden, inter, kv, vocab = (8, 2048, 5632, 512, 32000) if gpu else (2, 256, 688, 64, 2048)
    bf16, fp32 = torch.bfloat16, torch.float32
    spec: Spec = [("model.embed_tokens.weight", (vocab, hidden), bf16)]
    for i in range(layers):
        p = f"model.layers.{i}."
        spec += [
            (p + "input_layernorm.weight", (hidden,), fp32),
            (p + "self_attn.q_proj.weight", (hidden, hidden), bf16),
            (p + "self_attn.k_proj.weight", (kv, hidden), bf16),
            (p + "self_attn.v_proj.weight", (kv, hidden), bf16),
            (p + "self_attn.o_proj.weight", (hidden, hidden), bf16),
            (p + "post_attention_layernorm.weight", (hidden,), fp32),
            (p + "mlp.gate_proj.weight", (inter, hidden), bf16),
            (p + "mlp.up_proj.weight", (inter, hidden), bf16),
            (p + "mlp.down_proj.weight", (hidden, inter), bf16),
        ]
    return spec + [("model.norm.weight", (hidden,), fp32), ("lm_head.weight", (vocab, hidden), bf16)]


def spec_bytes(spec: Spec) -> int:
    return sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in spec)


def metadata(tensors: Named) -> list[tuple[str, tuple[tuple[int, ...], torch.dtype]]]:
    return [(n, (tuple(t.shape), t.dtype)) for n, t in tensors.items()]


# ---------------------------------------------------------------------------------------------
# Bit-exact round trip of every dtype


def dtype_items(device: torch.device, seed: int = 0) -> Named:
    """Per dtype: a scalar, an odd-sized vector (misaligns what follows), a matrix, a transposed
    (non-contiguous) view, an empty tensor and one larger than the chunk target (sent alone)."""
    gen = torch.Generator().manual_seed(seed)
    out: Named = {}
    for dtype in ROUND_TRIP_DTYPES:
        tag = str(dtype).removeprefix("torch.")
        big = ROUND_TRIP_BUFFER // dtype.itemsize + 1000
        for label, shape in (("scalar", ()), ("odd", (7,)), ("matrix", (33, 17)), ("empty", (0, 5)), ("big", (big,))):
            out[f"{tag}.{label}"] = fill_random(torch.empty(shape, dtype=dtype), gen).to(device)
        out[f"{tag}.transposed"] = fill_random(torch.empty(16, 24, dtype=dtype), gen).to(device).t()
    return out


def _send(group: LoopbackGroup, items: Named, **options: Any) -> None:
    packed_broadcast_producer(iter(items.items()), group, 0, lambda item: item[1],
                              buffer_size_bytes=ROUND_TRIP_BUFFER, **options)


def round_trip(items: Named, wire: torch.device, mode: str, num_buffers: int) -> list[str]:
    """Send ``items`` through a loopback group on ``wire`` and return the mismatching names.

    ``mode``: ``fresh`` (callback keeps the views it gets), ``reuse`` (pooled buffers, callback
    copies), ``iterator`` (``return_iterator=True``) or ``legacy`` (vLLM's packing rule).
    """
    group = LoopbackGroup(wire)
    legacy = mode == "legacy"
    _send(group, items, num_buffers=num_buffers, use_legacy_packing=legacy)
    group.receive()
    meta = metadata(items)
    received: Named = {}
    common = {"buffer_size_bytes": ROUND_TRIP_BUFFER, "num_buffers": num_buffers, "use_legacy_packing": legacy}
    if mode == "iterator":
        flat = packed_broadcast_consumer(iter(meta), group, 0, None, return_iterator=True, **common)
        assert flat is not None
        received = {n: t.clone() for n, t in flat}
    else:
        keep = mode == "fresh"

        def load(batch: list[tuple[str, torch.Tensor]]) -> None:
            received.update((n, t if keep else t.clone()) for n, t in batch)

        packed_broadcast_consumer(iter(meta), group, 0, load, reuse_buffers=mode == "reuse", **common)
    sync(wire)
    if group.pending():
        return [f"{group.pending()} broadcasts never received"]
    return mismatches(items, received)


def check_dtypes(source: torch.device, wire: torch.device) -> list[Row]:
    """One row: every dtype, shape kind and consumer mode round-trips bit for bit."""
    items = dtype_items(source)
    runs = [("fresh", 2), ("fresh", 1), ("reuse", 2), ("iterator", 2), ("legacy", 2)]
    bad = {f"{mode} x{count}": round_trip(items, wire, mode, count) for mode, count in runs}
    bad = {k: v for k, v in bad.items() if v}
    where = f"{source.type}->{wire.type} wire, {len(ROUND_TRIP_DTYPES)} dtypes"
    if bad:
        figure = "; ".join(f"{k}: {', '.join(v[:4])}" for k, v in bad.items())
    else:
        figure = f"{len(items)} tensors x {len(runs)} consumer modes bit-exact (64 KiB chunks)"
    return [Row("packed round trip, all dtypes", where, verdict(not bad), figure)]


# ---------------------------------------------------------------------------------------------
# Throughput: packed vs per-tensor vs one flat copy


def check_throughput(device: torch.device, gpu: bool, targets: list[int], repeats: int) -> list[Row]:
    """Producer + consumer round trip of a transformer-shaped set through the loopback group:
    packed (at each chunk target), one broadcast per tensor, and one flat broadcast of all bytes."""
    spec = transformer_spec(gpu)
    total = spec_bytes(spec)
    params = random_tensors(spec, 1, device)
    dest = {n: torch.zeros_like(t) for n, t in params.items()}
    flat_src = torch.cat([t.view(-1).view(torch.uint8) for t in params.values()])
    flat_dst = torch.zeros_like(flat_src)
    meta = metadata(params)

    def load(batch: list[tuple[str, torch.Tensor]]) -> None:
        for n, t in batch:
            dest[n].copy_(t)

    def packed(target: int) -> Callable[[], None]:
        def run() -> None:
            group = LoopbackGroup(device)
            packed_broadcast_producer(iter(params.items()), group, 0, lambda item: item[1], buffer_size_bytes=target)
            group.receive()
            packed_broadcast_consumer(iter(meta), group, 0, load, buffer_size_bytes=target, reuse_buffers=True)
        return run

    def one_by_one(sources: list[torch.Tensor], sinks: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            group = LoopbackGroup(device)
            for t in sources:
                group.broadcast(t.view(-1).view(torch.uint8), 0)
            group.receive()
            for t in sinks:
                group.broadcast(t.view(-1).view(torch.uint8), 0)
        return run

    def params_exact() -> bool:
        return not mismatches(params, dest)

    ways: list[tuple[str, Callable[[], None], Callable[[], bool]]] = [
        (f"packed, {t / 2**20:,.0f} MiB chunks", packed(t), params_exact) for t in targets
    ]
    ways.append(("per-tensor", one_by_one(list(params.values()), list(dest.values())), params_exact))
    ways.append(("one flat broadcast", one_by_one([flat_src], [flat_dst]), lambda: torch.equal(flat_src, flat_dst)))
    where = f"{device.type}, bf16+fp32, {len(spec)} tensors, {total / 1e6:.0f} MB"
    rows: list[Row] = []
    for label, fn, exact in ways:
        for t in [*dest.values(), flat_dst]:
            t.zero_()
        fn()  # warm-up and the bit-exact pass
        ok = bool(exact())
        seconds = best_time(device, fn, repeats)
        figure = f"{gbps(total, seconds):.2f} GB/s round trip" + ("" if ok else ", NOT bit-exact")
        rows.append(Row(f"loopback {label}", where, verdict(ok), figure))
    return rows
