"""Packed broadcast round trips through a recording fake group, in one process.

The fake is the far side of the broadcast interface only: it records what the producer sends
(checking that no buffer changes while its broadcast is in flight) and replays it to the
consumer (writing garbage at launch and the real bytes only at ``wait()``, so reading before
waiting or reusing a buffer the caller still holds shows up as wrong values).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nrl_tasks.utils.packed_tensor import (
    CPU_DEFAULT_TARGET_BYTES,
    _packed_broadcast_consumer_batches,
    get_num_buffers,
    get_target_packed_tensor_size,
    packed_broadcast_consumer,
    packed_broadcast_producer,
    release_packed_buffers,
)

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, *FLOAT8]


class _Handle:
    def __init__(self, group: RecordingGroup, tensor: torch.Tensor, snapshot: torch.Tensor | None, index: int) -> None:
        self.group, self.tensor, self.snapshot, self.index = group, tensor, snapshot, index
        self.done = False

    def wait(self) -> bool:
        if not self.done:
            self.done = True
            self.group.finish(self)
        return True


class RecordingGroup:
    """Fake asynchronous group: rank ``src`` records, any other rank replays ``sent``."""

    def __init__(self, rank: int, sent: list[torch.Tensor] | None = None, log: list[str] | None = None) -> None:
        self.rank = rank
        self.sent: list[torch.Tensor] = [] if sent is None else sent
        self.launched = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.storages: set[int] = set()
        self.log = log if log is not None else []
        self.errors: list[str] = []

    def _start(self, tensor: torch.Tensor, src: int) -> _Handle:
        assert tensor.dtype == torch.uint8 and tensor.dim() == 1 and tensor.is_contiguous()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.storages.add(tensor.untyped_storage().data_ptr())
        self.log.append(f"launch {self.launched}")
        index = self.launched
        self.launched += 1
        if self.rank == src:
            return _Handle(self, tensor, tensor.clone(), index)
        if index >= len(self.sent):
            raise AssertionError(f"consumer launched broadcast #{index} but the producer sent {len(self.sent)}")
        if self.sent[index].numel() != tensor.numel():
            raise AssertionError(f"broadcast #{index}: producer sent {self.sent[index].numel()} bytes, consumer expects {tensor.numel()}")
        tensor.fill_(0xA5)  # not arrived yet
        return _Handle(self, tensor, None, index)

    def finish(self, handle: _Handle) -> None:
        self.in_flight -= 1
        if handle.snapshot is not None:
            if not torch.equal(handle.snapshot, handle.tensor):
                self.errors.append(f"broadcast #{handle.index} changed while in flight")
            self.sent.append(handle.snapshot)
        else:
            handle.tensor.copy_(self.sent[handle.index])

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> _Handle:
        return self._start(tensor, src)


class SyncRecordingGroup(RecordingGroup):
    """Only a synchronous ``broadcast(tensor, src)``, like vLLM's PyNcclCommunicator."""

    broadcast_async = None  # type: ignore[assignment]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._start(tensor, src).wait()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    raw = t.view(-1).view(torch.uint8) if t.numel() else None
    if raw is not None:
        raw.random_(0, 256, generator=gen)
    if dtype == torch.bool:
        t = t.view(-1).view(torch.uint8).remainder_(2).view(torch.bool).view(shape)
    return t


def mixed_params(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Every dtype, scalars, zero-element, non-contiguous and odd-sized tensors (misaligned offsets)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[tuple[str, torch.Tensor]] = []
    for i, dtype in enumerate(DTYPES):
        out.append((f"{dtype}.odd", _random((3, 5 + i), dtype, gen)))
        out.append((f"{dtype}.scalar", _random((), dtype, gen)))
        out.append((f"{dtype}.empty", _random((0, 4), dtype, gen)))
        out.append((f"{dtype}.transposed", _random((7, 4), dtype, gen).t()))
    out.append(("strided", _random((20, 9), torch.float32, gen)[::3, 1::2]))
    out.append(("big", _random((64, 33), torch.float32, gen)))
    return out


def metadata(params: list[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[torch.Size, torch.dtype]]]:
    return [(n, (t.shape, t.dtype)) for n, t in params]


def round_trip(params, target, legacy=False, prod_buffers=2, cons_buffers=2, sync=False, reuse_buffers=False):
    """Send ``params`` through the fakes; returns (received copies, producer group, consumer group)."""
    cls = SyncRecordingGroup if sync else RecordingGroup
    prod = cls(rank=0)
    packed_broadcast_producer(iter(params), prod, 0, lambda item: item[1], buffer_size_bytes=target,
                              num_buffers=prod_buffers, use_legacy_packing=legacy)
    assert prod.errors == [] and prod.in_flight == 0
    cons = cls(rank=1, sent=prod.sent)
    received: list[tuple[str, torch.Tensor]] = []
    packed_broadcast_consumer(iter(metadata(params)), cons, 0, lambda batch: received.extend((n, t.clone()) for n, t in batch),
                              buffer_size_bytes=target, num_buffers=cons_buffers, use_legacy_packing=legacy,
                              reuse_buffers=reuse_buffers)
    assert cons.in_flight == 0 and cons.launched == len(prod.sent)
    return received, prod, cons


def assert_same(params, received):
    assert [n for n, _ in received] == [n for n, _ in params]
    for (name, want), (_, got) in zip(params, received):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.equal(_bytes(got), _bytes(want)), f"{name} differs"


@pytest.mark.parametrize("legacy", [False, True], ids=["default", "legacy"])
@pytest.mark.parametrize("target", [1, 13, 64, 500, 1 << 20])
@pytest.mark.parametrize("buffers", [(1, 1), (2, 3), (3, 1)], ids=lambda b: f"prod{b[0]}-cons{b[1]}")
def test_round_trip_mixed_dtypes(legacy, target, buffers):
    params = mixed_params()
    received, prod, _ = round_trip(params, target, legacy, *buffers)
    assert_same(params, received)
    total = sum(t.numel() * t.element_size() for _, t in params)
    assert sum(s.numel() for s in prod.sent) == total  # raw bytes only, no padding or headers


def test_sync_group_like_pynccl():
    params = mixed_params(1)
    received, prod, cons = round_trip(params, 48, sync=True)
    assert_same(params, received)
    assert prod.max_in_flight == cons.max_in_flight == 1


def test_default_chunks_never_exceed_target_and_oversized_travel_alone():
    target = 64
    params = [("a", torch.arange(10, dtype=torch.int32)),  # 40 B
              ("b", torch.arange(10, dtype=torch.int32)),  # 40 B: would exceed -> new chunk
              ("big", torch.arange(50, dtype=torch.int32)),  # 200 B > target: alone, zero-copy
              ("c", torch.arange(3, dtype=torch.int16)),
              ("d", torch.arange(4, dtype=torch.int64))]
    received, prod, _ = round_trip(params, target)
    assert_same(params, received)
    assert [s.numel() for s in prod.sent] == [40, 40, 200, 6 + 32]


def test_oversized_is_sent_from_its_own_storage():
    big = torch.arange(1000, dtype=torch.float32)
    prod = RecordingGroup(rank=0)
    packed_broadcast_producer(iter([("small", torch.ones(2)), ("big", big)]), prod, 0, lambda it: it[1], buffer_size_bytes=100)
    assert big.untyped_storage().data_ptr() in prod.storages


def test_legacy_packs_oversized_with_predecessors():
    params = [("a", torch.ones(10)), ("b", torch.ones(10)), ("big", torch.ones(125)), ("c", torch.ones(5))]
    received, prod, _ = round_trip(params, 100, legacy=True)
    assert_same(params, received)
    assert [s.numel() for s in prod.sent] == [40 + 40 + 500, 20]  # vLLM's rule: append, cut once > target
    _, prod_default, _ = round_trip(params, 100)
    assert [s.numel() for s in prod_default.sent] == [80, 500, 20]


@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reuse"])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_in_flight_and_buffers_bounded(count, reuse):
    params = [(f"p{i}", torch.full((16,), float(i))) for i in range(40)]  # 64 B each
    received, prod, cons = round_trip(params, 128, prod_buffers=count, cons_buffers=count, reuse_buffers=reuse)
    assert_same(params, received)
    assert len(prod.sent) == 20
    for side in (prod, cons):
        assert side.max_in_flight == count  # overlap really happens, and never beyond the bound
    for side in (prod, cons) if reuse else (prod,):
        assert len(side.storages) <= count  # buffers reused, never more than `count`


def _keep_everything(params, target, count, **kwargs) -> list[list[tuple[str, torch.Tensor]]]:
    """NeMo-RL-style consumer: the callback keeps every batch it is handed, without a copy."""
    prod = RecordingGroup(rank=0)
    packed_broadcast_producer(iter(params), prod, 0, lambda item: item[1], buffer_size_bytes=target, num_buffers=count)
    batches: list[list[tuple[str, torch.Tensor]]] = []
    packed_broadcast_consumer(iter(metadata(params)), RecordingGroup(rank=1, sent=prod.sent), 0, batches.append,
                              buffer_size_bytes=target, num_buffers=count, **kwargs)
    return batches


def _storages(batch: list[tuple[str, torch.Tensor]]) -> set[int]:
    return {t.untyped_storage().data_ptr() for _, t in batch if t.numel()}


@pytest.mark.parametrize("count", [1, 2])
def test_callback_may_keep_tensors_by_default(count):
    params = [(f"p{i}", torch.full((4, 4), float(i))) for i in range(10)] + mixed_params(5)
    batches = _keep_everything(params, 64, count)
    assert len(batches) > 2 * count  # enough batches that reused buffers would be overwritten
    round_trip(params, 64, reuse_buffers=True)  # a later refit in this process must not touch them either
    assert_same(params, [named for batch in batches for named in batch])
    for i, batch in enumerate(batches):  # no batch shares a receive buffer with another
        assert all(not _storages(batch) & _storages(other) for other in batches[i + 1 :])


def test_reuse_buffers_hands_out_views_that_later_batches_overwrite():
    params = [(f"p{i}", torch.full((16,), float(i))) for i in range(8)]  # 64 B each: one batch per tensor
    batches = _keep_everything(params, 64, 2, reuse_buffers=True)
    kept = [named for batch in batches for named in batch]
    assert len(set().union(*map(_storages, batches))) <= 2  # zero-copy: two receive buffers, reused
    assert not torch.equal(kept[0][1], params[0][1])  # as documented: a kept view gets overwritten
    assert torch.equal(kept[-1][1], params[-1][1])  # the last batch is intact until its buffer's next use


def _tiny_views() -> list[tuple[str, torch.Tensor]]:
    """0- and 1-element views whose stride is not 1 (they still count as contiguous)."""
    row = torch.arange(7, dtype=torch.float32).reshape(1, 7)
    return [("row[:, 0]", row[:, 0]), ("empty[:, 0]", torch.zeros(0, 5, dtype=torch.float64)[:, 0]),
            ("cell", torch.arange(12, dtype=torch.int16).reshape(1, 1, 12)[:, :, 3::5][:, :, :1])]


@pytest.mark.parametrize("target", [1, 4, 1 << 10], ids=["alone", "alone-exact", "mixed"])
@pytest.mark.parametrize("legacy", [False, True], ids=["default", "legacy"])
def test_tiny_strided_views_round_trip(target, legacy):
    views = _tiny_views()
    assert all(t.is_contiguous() and t.stride()[-1] != 1 for _, t in views)
    for params in ([views[0]], [views[1]], views,
                   [("flag", torch.tensor([True])), views[0], ("big", torch.ones(300)), views[1], views[2]]):
        received, _, _ = round_trip(params, target, legacy)
        assert_same(params, received)


def test_empty_iterator_sends_nothing():
    prod = RecordingGroup(rank=0)
    packed_broadcast_producer(iter([]), prod, 0, lambda it: it[1], buffer_size_bytes=8)
    assert prod.launched == 0
    cons = RecordingGroup(rank=1, sent=[])
    assert list(packed_broadcast_consumer(iter([]), cons, 0, None, return_iterator=True, buffer_size_bytes=8)) == []
    packed_broadcast_consumer(iter([]), cons, 0, lambda batch: pytest.fail("no batch expected"), buffer_size_bytes=8)
    assert cons.launched == 0


def test_lazy_iterators_on_both_sides():
    log: list[str] = []
    params = [(f"p{i}", torch.full((8,), float(i))) for i in range(12)]  # 32 B each

    def produce():
        for name, t in params:
            log.append(f"make {name}")
            yield name, t

    prod = RecordingGroup(rank=0, log=log)
    packed_broadcast_producer(produce(), prod, 0, lambda it: it[1], buffer_size_bytes=64, num_buffers=1)
    assert log.index("launch 0") < log.index("make p11")  # streams: sends before it has read everything

    cons = RecordingGroup(rank=1, sent=prod.sent)
    flat = packed_broadcast_consumer(iter(metadata(params)), cons, 0, None, return_iterator=True, buffer_size_bytes=64, num_buffers=2)
    assert cons.launched == 0  # nothing received before the first item is asked for
    name, tensor = next(flat)
    first = (name, tensor.clone())  # views are valid only until the iterator leaves their batch
    assert name == "p0" and cons.launched == 2
    rest = [(n, t.clone()) for n, t in flat]
    assert_same(params, [first, *rest])


def test_batches_keep_buffers_until_next_request():
    params = [(f"p{i}", torch.full((4,), float(i), dtype=torch.float64)) for i in range(6)]
    received, prod, _ = round_trip(params, 64)
    cons = RecordingGroup(rank=1, sent=prod.sent)
    batches = _packed_broadcast_consumer_batches(iter(metadata(params)), cons, 0, num_buffers=1, buffer_size_bytes=64)
    seen = []
    for batch in batches:
        assert cons.in_flight == 0  # one buffer: held by this batch, nothing else in flight
        seen.extend((n, t.clone()) for n, t in batch)
    assert_same(params, seen)


def test_misaligned_pieces_are_realigned():
    params = [("flag", torch.tensor([True])), ("x", torch.arange(5, dtype=torch.float64)),
              ("h", torch.arange(3, dtype=torch.float16)), ("y", torch.arange(4, dtype=torch.int32))]
    prod = RecordingGroup(rank=0)
    packed_broadcast_producer(iter(params), prod, 0, lambda it: it[1], buffer_size_bytes=1 << 10)
    assert len(prod.sent) == 1
    cons = RecordingGroup(rank=1, sent=prod.sent)
    got = [(n, t.clone()) for n, t in packed_broadcast_consumer(iter(metadata(params)), cons, 0, None,
                                                              return_iterator=True, buffer_size_bytes=1 << 10)]
    assert_same(params, got)


def test_post_iter_func_casts_before_packing():
    params = [("w", torch.randn(6, 3)), ("b", torch.randn(3))]
    prod = RecordingGroup(rank=0)
    packed_broadcast_producer(iter(params), prod, 0, lambda it: it[1].to(torch.bfloat16), buffer_size_bytes=1024)
    assert sum(s.numel() for s in prod.sent) == (18 + 3) * 2
    cons = RecordingGroup(rank=1, sent=prod.sent)
    meta = [(n, (t.shape, torch.bfloat16)) for n, t in params]
    got = list(packed_broadcast_consumer(iter(meta), cons, 0, None, return_iterator=True, buffer_size_bytes=1024))
    for (_, want), (_, have) in zip(params, got):
        assert torch.equal(have, want.to(torch.bfloat16))


def test_bad_inputs_raise_clear_errors():
    group = RecordingGroup(rank=0)
    with pytest.raises(TypeError, match="'w'"):
        packed_broadcast_producer(iter([("w", torch.ones(2))]), group, 0, lambda it: [1, 2])
    with pytest.raises(TypeError, match=r"\(name, tensor\)"):
        packed_broadcast_producer(iter([torch.ones(2)]), group, 0, lambda it: it)
    with pytest.raises(ValueError, match="buffer_size_bytes"):
        packed_broadcast_producer(iter([]), group, 0, None, buffer_size_bytes=0)
    with pytest.raises(ValueError, match="num_buffers"):
        packed_broadcast_consumer(iter([]), group, 0, None, True, num_buffers=0)
    with pytest.raises(TypeError, match="dtype of 'w'"):
        list(packed_broadcast_consumer(iter([("w", ((2,), "float32"))]), RecordingGroup(1, [torch.zeros(8, dtype=torch.uint8)]), 0, None, True))
    with pytest.raises(TypeError, match="post_unpack_func"):
        packed_broadcast_consumer(iter([]), group, 0, None)
    with pytest.raises(TypeError, match="ProcessGroup"):
        packed_broadcast_producer(iter([("w", torch.ones(2))]), object(), 0, None)


def test_consumer_size_mismatch_is_detected_not_garbage():
    params = [("w", torch.ones(10))]
    _, prod, _ = round_trip(params, 1024)
    cons = RecordingGroup(rank=1, sent=prod.sent)
    with pytest.raises(AssertionError, match="producer sent 40 bytes"):
        packed_broadcast_consumer(iter([("w", ((11,), torch.float32))]), cons, 0, lambda b: None, buffer_size_bytes=1024)


def test_env_defaults(monkeypatch):
    monkeypatch.delenv("NRL_REFIT_BUFFER_SIZE_BYTES", raising=False)
    monkeypatch.delenv("NRL_REFIT_NUM_BUFFERS", raising=False)
    if not torch.cuda.is_available():
        assert get_target_packed_tensor_size() == CPU_DEFAULT_TARGET_BYTES
    assert get_num_buffers() == 2
    monkeypatch.setenv("NRL_REFIT_BUFFER_SIZE_BYTES", "12345")
    monkeypatch.setenv("NRL_REFIT_NUM_BUFFERS", "3")
    assert get_target_packed_tensor_size() == 12345 and get_num_buffers() == 3
    monkeypatch.setenv("NRL_REFIT_NUM_BUFFERS", "zero")
    with pytest.raises(ValueError, match="NRL_REFIT_NUM_BUFFERS"):
        get_num_buffers()
    monkeypatch.setenv("NRL_REFIT_BUFFER_SIZE_BYTES", "-1")
    with pytest.raises(ValueError, match="NRL_REFIT_BUFFER_SIZE_BYTES"):
        get_target_packed_tensor_size()


def test_buffers_are_reused_across_calls():
    release_packed_buffers()
    params = [(f"p{i}", torch.ones(64)) for i in range(8)]
    _, first, _ = round_trip(params, 512)
    _, second, _ = round_trip(params, 512)
    assert first.storages & second.storages  # the second refit reuses warm buffers
    assert release_packed_buffers() > 0 and release_packed_buffers() == 0


_shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=30, deadline=None)
@given(
    specs=st.lists(st.tuples(_shapes, st.sampled_from(DTYPES)), min_size=0, max_size=12),
    target=st.integers(1, 200),
    legacy=st.booleans(),
    prod_buffers=st.integers(1, 3),
    cons_buffers=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(specs, target, legacy, prod_buffers, cons_buffers, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [(f"t{i}", _random(shape, dtype, gen)) for i, (shape, dtype) in enumerate(specs)]
    received, prod, cons = round_trip(params, target, legacy, prod_buffers, cons_buffers)
    assert_same(params, received)
    assert max(prod.max_in_flight, 0) <= prod_buffers and cons.max_in_flight <= cons_buffers
    if not legacy:
        sizes = [math.prod(s) * d.itemsize for s, d in specs]
        assert all(s.numel() <= target or s.numel() in sizes for s in prod.sent)


class _NoStream:
    def synchronize(self) -> None:
        pass


def _vllm_packed_module(monkeypatch):
    """vLLM's packed_tensor module, its CUDA stream plumbing neutralised when there is no GPU."""
    import contextlib
    import importlib
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed in this venv: interop with vLLM's packed consumer is untested here "
                    "(run this test in .venv-vllm)")
    try:
        module = importlib.import_module("vllm.distributed.weight_transfer.packed_tensor")
    except ImportError as exc:
        pytest.skip(f"this vllm has no weight_transfer.packed_tensor: {exc}")
    if not torch.cuda.is_available():  # only the stream plumbing is faked; packing logic is vLLM's own
        monkeypatch.setattr(module, "_get_streams", lambda index, count: tuple(_NoStream() for _ in range(count)))
        monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    return module


def _interop_params() -> list[tuple[str, torch.Tensor]]:
    # vLLM's unpack views bytes in place (no realignment, no 0-dim shapes): model-like tensors only.
    gen = torch.Generator().manual_seed(11)
    shapes = [((64, 32), torch.bfloat16), ((32,), torch.float32), ((700, 8), torch.float32),
              ((16, 16), torch.bfloat16), ((8,), torch.bfloat16), ((3, 64), torch.float32)]
    return [(f"layer.{i}", _random(shape, dtype, gen)) for i, (shape, dtype) in enumerate(shapes)]


def test_legacy_packing_interops_with_vllm(monkeypatch):
    """Our legacy producer feeds vLLM's consumer, and vLLM's producer feeds our legacy consumer."""
    module = _vllm_packed_module(monkeypatch)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = 4096  # the 700x8 float32 tensor (22400 B) is oversized: packed with its predecessors
    params = [(n, t.to(device)) for n, t in _interop_params()]
    prod = SyncRecordingGroup(rank=0)
    packed_broadcast_producer(iter(params), prod, 0, lambda it: it[1], buffer_size_bytes=target, use_legacy_packing=True)
    received: list[tuple[str, torch.Tensor]] = []
    module.packed_nccl_broadcast_consumer(iter(metadata(params)), SyncRecordingGroup(rank=1, sent=prod.sent), 0,
                                          lambda batch: received.extend((n, t.clone()) for n, t in batch),
                                          buffer_size_bytes=target, num_buffers=2, device=device)
    assert_same(params, received)

    theirs = SyncRecordingGroup(rank=0)
    module.packed_nccl_broadcast_producer(iter(params), theirs, 0, lambda it: it[1], buffer_size_bytes=target, num_buffers=2)
    assert [s.numel() for s in theirs.sent] == [s.numel() for s in prod.sent]  # same chunk boundaries
    ours = [(n, t.clone()) for n, t in packed_broadcast_consumer(
        iter(metadata(params)), SyncRecordingGroup(rank=1, sent=theirs.sent), 0, None,
        return_iterator=True, buffer_size_bytes=target, use_legacy_packing=True)]
    assert_same(params, ours)
