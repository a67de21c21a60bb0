"""Refit protocol: metadata, fingerprints, the mismatch error, RefitInfo over JSON, checksums, flat buckets."""

from __future__ import annotations

import json

import pytest
import torch

from nrl_tasks.utils.packed_tensor import packed_broadcast_consumer, packed_broadcast_producer
from nrl_tasks.utils.refit import (
    FlatParamBuckets,
    RefitInfo,
    RefitMismatchError,
    check_fingerprints,
    dtype_from_str,
    metadata_to_consumer_iter,
    refit_fingerprint,
    refit_metadata,
    weights_checksum,
)
from tests.utils.test_packed_tensor import RecordingGroup, mixed_params

SIZE = 1 << 20


def _model() -> list[tuple[str, torch.Tensor]]:
    return [("embed.weight", torch.randn(10, 4)), ("layer.0.weight", torch.randn(4, 4).to(torch.bfloat16)),
            ("layer.0.bias", torch.zeros(4)), ("head.weight", torch.randn(10, 4))]


def test_metadata_in_iteration_order():
    meta = refit_metadata(iter(_model()))
    assert meta == [("embed.weight", (10, 4), torch.float32), ("layer.0.weight", (4, 4), torch.bfloat16),
                    ("layer.0.bias", (4,), torch.float32), ("head.weight", (10, 4), torch.float32)]
    assert list(metadata_to_consumer_iter(meta))[1] == ("layer.0.weight", ((4, 4), torch.bfloat16))
    with pytest.raises(ValueError, match="'a' appears twice"):
        refit_metadata([("a", torch.ones(1)), ("a", torch.ones(1))])
    with pytest.raises(TypeError, match="'a'"):
        refit_metadata([("a", [1.0])])


def test_fingerprint_changes_with_any_field_and_buffer_size():
    meta = refit_metadata(_model())
    fp = refit_fingerprint(meta, SIZE)
    assert fp == refit_fingerprint(list(meta), SIZE)
    variants = [
        [("embed.w", *meta[0][1:]), *meta[1:]],
        [(meta[0][0], (10, 5), meta[0][2]), *meta[1:]],
        [(meta[0][0], meta[0][1], torch.float16), *meta[1:]],
        [meta[1], meta[0], *meta[2:]],
        meta[:-1],
    ]
    assert len({fp, *(refit_fingerprint(v, SIZE) for v in variants), refit_fingerprint(meta, SIZE + 1)}) == 7


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda m: [m[0], ("layer.0.weight", (4, 5), torch.bfloat16), *m[2:]], r"'layer.0.weight' \(#1\): shape expected \[4, 4\], producer sends \[4, 5\]"),
        (lambda m: [m[0], m[1], ("layer.0.bias", (4,), torch.float16), m[3]], r"'layer.0.bias' \(#2\): dtype expected float32, producer sends float16"),
        (lambda m: [m[0], ("layer.0.w", (4, 4), torch.bfloat16), *m[2:]], r"#1: expected 'layer.0.weight'.*producer sends 'layer.0.w'"),
        (lambda m: m[:3], r"'head.weight' \(#3\) is missing"),
        (lambda m: [*m, ("extra", (1,), torch.float32)], r"extra parameter 'extra' \(#4\)"),
    ],
    ids=["shape", "dtype", "name", "missing", "extra"],
)
def test_mismatch_names_first_differing_parameter(change, match):
    expected = refit_metadata(_model())
    got = change(expected)
    got[-1:] = got[-1:]  # the first difference is the one reported, even with later ones
    with pytest.raises(RefitMismatchError, match=match):
        check_fingerprints(expected, refit_fingerprint(expected, SIZE), got, refit_fingerprint(got, SIZE))


def test_mismatch_reports_first_of_several_differences():
    expected = refit_metadata(_model())
    got = [expected[0], ("layer.0.weight", (4, 4), torch.float32), ("layer.0.bias", (5,), torch.float32), expected[3]]
    with pytest.raises(RefitMismatchError, match="'layer.0.weight'"):
        check_fingerprints(expected, refit_fingerprint(expected, SIZE), got, refit_fingerprint(got, SIZE))


def test_buffer_size_mismatch_and_match():
    meta = refit_metadata(_model())
    check_fingerprints(meta, refit_fingerprint(meta, SIZE), meta, refit_fingerprint(meta, SIZE))
    with pytest.raises(RefitMismatchError, match="buffer sizes differ"):
        check_fingerprints(meta, refit_fingerprint(meta, SIZE), meta, refit_fingerprint(meta, 2 * SIZE))
    assert issubclass(RefitMismatchError, ValueError)


def test_refit_info_travels_as_json():
    info = RefitInfo.build(_model(), SIZE, weights_version=3)
    wire = json.loads(json.dumps(info.to_dict()))
    assert wire["metadata"][1] == ["layer.0.weight", [4, 4], "bfloat16"]
    back = RefitInfo.from_dict(wire)
    assert back == info and back.total_bytes == (40 + 40 + 4) * 4 + 16 * 2
    back.check(refit_metadata(_model()), SIZE)
    with pytest.raises(RefitMismatchError, match="buffer sizes differ"):
        back.check(refit_metadata(_model()), SIZE // 2)
    with pytest.raises(ValueError, match="'weights_version'"):
        RefitInfo.from_dict({k: v for k, v in wire.items() if k != "weights_version"})
    with pytest.raises(ValueError, match="unknown torch dtype 'floaty'"):
        dtype_from_str("floaty")


def test_weights_checksum_detects_one_bit_and_ignores_layout():
    params = mixed_params(5)
    digest = weights_checksum(params)
    assert digest == weights_checksum([(n, t.contiguous().clone()) for n, t in params])
    flipped = [(n, t.clone()) for n, t in params]
    raw = flipped[-1][1].view(-1).view(torch.uint8)
    raw[7] ^= 1
    assert weights_checksum(flipped) != digest
    assert weights_checksum([("a", torch.ones(2))]) != weights_checksum([("b", torch.ones(2))])
    assert weights_checksum([("a", torch.ones(2))]) != weights_checksum([("a", torch.ones(2, dtype=torch.float64))])


def test_protocol_end_to_end_through_fake_group():
    """Announce, check, stream, verify: what the Policy and generation workers do."""
    params = mixed_params(9)
    info = RefitInfo.from_dict(json.loads(json.dumps(RefitInfo.build(params, 256, weights_version=4).to_dict())))
    expected = [(n, tuple(t.shape), t.dtype) for n, t in params]
    info.check(expected, 256)
    prod = RecordingGroup(rank=0)
    packed_broadcast_producer(iter(params), prod, 0, lambda it: it[1], buffer_size_bytes=info.buffer_size_bytes)
    cons = RecordingGroup(rank=1, sent=prod.sent)
    got = [(n, t.clone()) for n, t in packed_broadcast_consumer(info.consumer_iter(), cons, 0, None, True,
                                                              buffer_size_bytes=info.buffer_size_bytes)]
    assert weights_checksum(got) == weights_checksum(params) and info.weights_version == 4


def test_flat_buckets_layout_and_zero_copy_broadcast():
    params = mixed_params(2)
    meta = refit_metadata(params)
    sender = FlatParamBuckets(meta, 256)
    sender.copy_from(params)
    assert len(sender) == len(params) and len(sender.buckets) > 1
    for name, view in sender.named_tensors():
        assert view.data_ptr() % FlatParamBuckets.ALIGN == 0 or view.numel() == 0, name
        assert any(view.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in sender.buckets)
    oversized = {t.numel() * t.element_size() for _, t in params if t.numel() * t.element_size() > 256}
    assert all(b.numel() <= 256 or b.numel() in oversized for b in sender.buckets)  # big tensors alone
    prod = RecordingGroup(rank=0)
    sender.broadcast(prod, 0, num_buffers=2)
    assert prod.max_in_flight == 2 and prod.storages == {b.untyped_storage().data_ptr() for b in sender.buckets}
    receiver = FlatParamBuckets(meta, 256)
    receiver.broadcast(RecordingGroup(rank=1, sent=prod.sent), 0)
    assert weights_checksum(receiver.named_tensors()) == weights_checksum(params)
    assert receiver.fingerprint() == refit_fingerprint(meta, 256)
    with pytest.raises(ValueError, match="'big'"):
        receiver.copy_from([("big", torch.ones(3))])
    with pytest.raises(KeyError, match="'nope'"):
        receiver["nope"]


def test_flat_buckets_adopt_module_parameters():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    buckets = FlatParamBuckets(refit_metadata(module.named_parameters()), 100)
    buckets.adopt(module)
    for name, param in module.named_parameters():
        assert torch.equal(param, before[name])
        assert param.data_ptr() == buckets[name].data_ptr()  # the parameter now lives in a bucket
    module(torch.ones(3, 4)).sum().backward()
    with torch.no_grad():  # an SGD step, as an optimizer does it: in place on the parameters
        for param in module.parameters():
            param.add_(param.grad, alpha=-0.1)
    assert not torch.equal(buckets["0.weight"], before["0.weight"])  # training updates the buckets in place


def test_weights_checksum_is_xxh3_and_recorded_blake2b_checksums_are_recomputed_as_such():
    """New checksums are ``xxh3-128:<hex>``; a checksum recorded before (bare BLAKE2b-160 hex) is
    recomputed with BLAKE2b, byte for byte the old definition, so older runs still resume."""
    import ctypes
    import hashlib

    import xxhash

    from nrl_tasks.utils.refit import checksum_algorithm, weights_checksum

    g = torch.Generator().manual_seed(0)
    named = [("a.weight", torch.randn(3, 5, generator=g)), ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16))]

    def by_hand(digest):
        for name, t in named:
            digest.update(f"{name}|{list(t.shape)}|{str(t.dtype).removeprefix('torch.')}|".encode())
            digest.update((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.contiguous().data_ptr()))
        return digest.hexdigest()

    new, old = weights_checksum(named), weights_checksum(named, "blake2b-160")
    assert new == "xxh3-128:" + by_hand(xxhash.xxh3_128())
    assert old == by_hand(hashlib.blake2b(digest_size=20)) and len(old) == 40
    assert checksum_algorithm(new) == "xxh3-128" and checksum_algorithm(None) == "xxh3-128"
    assert checksum_algorithm(old) == "blake2b-160"
    named[0][1][0, 0] += 1.0
    assert weights_checksum(named) != new and weights_checksum(named, "blake2b-160") != old
    with pytest.raises(ValueError, match="unknown weights checksum algorithm"):
        weights_checksum(named, "md5")
