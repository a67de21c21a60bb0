"""Checksum algorithms: known digests, streaming equals one-shot, selection rules."""

from __future__ import annotations

import hashlib
import zlib

import pytest

from storage import checksum


def test_known_digests_and_streaming():
    data = bytes(range(256)) * 1000
    assert checksum.digest(data, "crc32") == f"{zlib.crc32(data):08x}"
    assert checksum.digest(data, "blake2b-128") == hashlib.blake2b(data, digest_size=16).hexdigest()
    for algorithm in checksum.available_algorithms():
        h = checksum.new_hasher(algorithm)
        for i in range(0, len(data), 999):
            h.update(memoryview(data)[i : i + 999])
        assert h.hexdigest() == checksum.digest(data, algorithm)
        flipped = bytearray(data)
        flipped[12345] ^= 0x10
        assert checksum.digest(bytes(flipped), algorithm) != checksum.digest(data, algorithm)


def test_combine_depends_on_order():
    assert checksum.combine(["a", "b"]) != checksum.combine(["b", "a"])
    assert checksum.combine([]) == checksum.combine([])


def test_selection(monkeypatch):
    monkeypatch.setenv("NRL_STORAGE_CHECKSUM", "blake2b-128")
    assert checksum.default_algorithm() == "blake2b-128"
    monkeypatch.setenv("NRL_STORAGE_CHECKSUM", "md4")
    with pytest.raises(ValueError, match="NRL_STORAGE_CHECKSUM"):
        checksum.default_algorithm()
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        checksum.new_hasher("md4")
    monkeypatch.delenv("NRL_STORAGE_CHECKSUM")
    expected = "xxh3-128" if "xxh3-128" in checksum.available_algorithms() else "crc32"
    assert checksum.default_algorithm() == expected
