"""Fuzzing ``load_batch`` with damaged datasets: truncated, flipped, extended, deleted or
duplicated shards and mutated manifests (raw bytes and JSON values).

Properties:

- default ``verify`` (full checksums): every mutation either loads data bit-identical to what
  was saved or raises a storage error (``CorruptDatasetError`` / ``NotCommittedError`` /
  ``MissingShardError``) naming a file of the dataset; never different data, never another
  exception type, never a crash of the interpreter, never a hang;
- ``verify="size"`` / ``"none"`` (no hashing: a flipped data byte may legitimately come through,
  the documented trade-off): still no crash, no hang, and only storage errors.

Every example runs on a fresh copy of one saved dataset; a per-example alarm turns a hang into
a failure.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import CorruptDatasetError, NotCommittedError, load_batch, save_batch
from tests.storage.helpers import every_kind_batch, same_batch

NUM_SHARDS = 3
ROWS = 7
HANG_S = 30

_SOURCE: dict[str, Any] = {}


def source() -> tuple[str, Any, list[str], dict]:
    """``(dataset dir, batch, shard names, manifest JSON)`` saved once per session."""
    if not _SOURCE:
        root = tempfile.mkdtemp(prefix="nrl-fuzz-src-")
        batch = every_kind_batch(rows=ROWS)
        path = os.path.join(root, "ds")
        save_batch(batch, path, num_shards=NUM_SHARDS)
        names = sorted(n for n in os.listdir(path) if n.startswith("part-"))
        with open(os.path.join(path, "_manifest.json"), encoding="utf-8") as fh:
            manifest = json.load(fh)
        _SOURCE.update(path=path, batch=batch, names=names, manifest=manifest)
    return _SOURCE["path"], _SOURCE["batch"], _SOURCE["names"], _SOURCE["manifest"]


@pytest.fixture(scope="module", autouse=True)
def _source_built_outside_strategies() -> Iterator[None]:
    """Build the source dataset before Hypothesis draws (strategies read it; building it draws
    from ``random``, which Hypothesis flags inside a strategy), and remove it afterwards."""
    path, *_ = source()
    yield
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    _SOURCE.clear()


@contextmanager
def fresh_copy() -> Iterator[str]:
    path, *_ = source()
    work = tempfile.mkdtemp(prefix="nrl-fuzz-")
    dst = os.path.join(work, "ds")
    shutil.copytree(path, dst)
    try:
        yield dst
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"load_batch hung for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# --------------------------------------------------------------------------- mutations
def _shard(draw: Any) -> int:
    return draw(st.integers(0, NUM_SHARDS - 1))


def _byte_edit_args(draw: Any, kind: str, max_append: int) -> tuple:
    """Arguments of byte edit ``kind``: truncate ``(fraction,)``, flip ``(fraction, xor)``,
    append ``(bytes,)``; ``()`` for kinds without arguments (delete, empty, ...)."""
    if kind == "truncate":
        return (draw(st.floats(0.0, 0.999)),)
    if kind == "flip":
        return (draw(st.floats(0.0, 0.999)), draw(st.integers(1, 255)))
    if kind == "append":
        return (draw(st.binary(min_size=1, max_size=max_append)),)
    return ()


def _edit_bytes(target: str, kind: str, args: tuple) -> None:
    """Rewrite file ``target`` with byte edit ``kind`` (args from :func:`_byte_edit_args`):
    truncate to a fraction of its length, XOR one byte, append bytes, or empty it."""
    data = bytearray(open(target, "rb").read())
    if kind == "truncate":
        data = data[: int(args[0] * len(data))]
    elif kind == "flip" and data:
        data[int(args[0] * len(data))] ^= args[1]
    elif kind == "append":
        data += args[0]
    elif kind == "empty":
        data = bytearray()
    with open(target, "wb") as fh:
        fh.write(data)


@st.composite
def shard_mutation(draw: Any) -> tuple:
    kind = draw(st.sampled_from(["truncate", "flip", "append", "delete", "duplicate", "extra", "empty"]))
    i = _shard(draw)
    if kind == "duplicate":
        j = draw(st.integers(0, NUM_SHARDS - 1).filter(lambda j: j != i))
        return (kind, i, j)
    return (kind, i, *_byte_edit_args(draw, kind, max_append=64))


def apply_shard_mutation(path: str, names: list[str], m: tuple) -> None:
    kind, i = m[0], m[1]
    target = os.path.join(path, names[i])
    if not os.path.exists(target):  # deleted by the first mutation of a pair
        return
    if kind == "delete":
        os.unlink(target)
    elif kind == "duplicate":  # shard j's file replaced by a copy of shard i
        shutil.copyfile(target, os.path.join(path, names[m[2]]))
    elif kind == "extra":  # an unexpected shard file next to the real ones
        shutil.copyfile(target, os.path.join(path, f"part-{NUM_SHARDS + 3:05d}.arrow"))
    else:
        _edit_bytes(target, kind, m[2:])


_PLAUSIBLE_STRINGS = [
    "tensor", "tensor_list", "arrow", "json", "float32", "int64", "int32", "bfloat16", "uint16",
    "uint8", "bool", "float16", "float64", "complex64", "int8", "part-00000.arrow", "part-00001.arrow",
    "part-00002.arrow", "xxh3-128", "crc32", "blake2b-128", "nrl-batch", "", "ids_1d", "input_ids",
    "text", "large_list<item: uint16>", "list<item: int64>", "fixed_size_list<item: int64>[7]",
]


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.extend(_paths(v, (*prefix, i)))
    return out


def _get(node: Any, path: tuple) -> Any:
    for p in path:
        node = node[p]
    return node


@st.composite
def manifest_json_mutation(draw: Any) -> tuple:
    """A structured edit of the manifest: a value replaced, a key dropped, a list reordered."""
    *_, manifest = source()
    paths = [p for p in _paths(manifest) if p]
    path = draw(st.sampled_from(paths))
    value = _get(manifest, path)
    options = ["delete", "random"]
    if isinstance(value, str):
        options.append("string")
    if isinstance(value, bool):
        options.append("not")
    elif isinstance(value, int):
        options.append("int")
    if isinstance(value, list) and len(value) > 1:
        options += ["reverse", "drop", "dup"]
    how = draw(st.sampled_from(options))
    arg: Any = None
    if how == "random":
        arg = draw(
            st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True), st.text(max_size=8),
                      st.lists(st.integers(0, 8), max_size=3), st.just({}))
        )
    elif how == "string":
        arg = draw(st.sampled_from(_PLAUSIBLE_STRINGS))
    elif how == "int":
        arg = draw(st.sampled_from([-1, 1, 2, 8, 1 << 20])) * draw(st.sampled_from([1, -1]))
    elif how in ("drop", "dup"):
        arg = draw(st.integers(0, len(value) - 1))
    return ("json", path, how, arg)


def apply_manifest_json_mutation(path: str, m: tuple) -> None:
    *_, manifest = source()
    data = copy.deepcopy(manifest)
    _, where, how, arg = m
    parent, key = _get(data, where[:-1]), where[-1]
    value = parent[key]
    if how == "delete":
        del parent[key]
    elif how in ("random", "string"):
        parent[key] = arg
    elif how == "not":
        parent[key] = not value
    elif how == "int":
        parent[key] = value + arg
    elif how == "reverse":
        parent[key] = value[::-1]
    elif how == "drop":
        parent[key] = value[:arg] + value[arg + 1 :]
    elif how == "dup":
        parent[key] = value[: arg + 1] + value[arg:]
    with open(os.path.join(path, "_manifest.json"), "w", encoding="utf-8") as fh:
        json.dump(data, fh)


@st.composite
def manifest_bytes_mutation(draw: Any) -> tuple:
    kind = draw(st.sampled_from(["truncate", "flip", "append", "delete", "empty"]))
    return ("mbytes", kind, *_byte_edit_args(draw, kind, max_append=32))


def apply_manifest_bytes_mutation(path: str, m: tuple) -> None:
    target = os.path.join(path, "_manifest.json")
    kind = m[1]
    if not os.path.exists(target):
        return
    if kind == "delete":
        os.unlink(target)
    else:
        _edit_bytes(target, kind, m[2:])


mutation = st.one_of(shard_mutation(), manifest_json_mutation(), manifest_bytes_mutation())


def apply(path: str, m: tuple) -> None:
    _, _, names, _ = source()
    if m[0] == "json":
        apply_manifest_json_mutation(path, m)
    elif m[0] == "mbytes":
        apply_manifest_bytes_mutation(path, m)
    else:
        apply_shard_mutation(path, names, m)


STORAGE_ERRORS = (CorruptDatasetError, NotCommittedError)  # MissingShardError is a CorruptDatasetError


def _load(path: str, **kw: Any) -> Any:
    with deadline(HANG_S):
        return load_batch(path, **kw)


def _check_clear(exc: BaseException, path: str, m: tuple) -> None:
    assert isinstance(exc, STORAGE_ERRORS), f"{m}: {type(exc).__name__} is not a storage error: {exc}"
    assert path in str(exc), f"{m}: the error does not name the dataset's file: {exc}"


# --------------------------------------------------------------------------- properties
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(m=st.one_of(mutation, st.tuples(mutation, mutation).map(lambda ms: ("pair", *ms))), use_mmap=st.booleans())
def test_full_verify_loads_identical_data_or_raises_a_clear_error(m, use_mmap):
    _, batch, _, _ = source()
    with fresh_copy() as path:
        for one in (m[1:] if m[0] == "pair" else (m,)):
            apply(path, one)
        try:
            got = _load(path, mmap=use_mmap)
        except BaseException as exc:  # noqa: BLE001 - classified below
            _check_clear(exc, path, m)
            return
        same_batch(batch, got)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(m=mutation, verify=st.sampled_from(["size", "none"]), use_mmap=st.booleans())
def test_cheap_verify_modes_never_crash_or_raise_foreign_errors(m, verify, use_mmap):
    with fresh_copy() as path:
        apply(path, m)
        try:
            got = _load(path, verify=verify, mmap=use_mmap)
        except BaseException as exc:  # noqa: BLE001
            _check_clear(exc, path, m)
            return
        assert set(got.keys()) == set(source()[1].keys())


@pytest.mark.parametrize("shard", range(NUM_SHARDS))
def test_every_byte_flip_of_one_shard_is_caught(shard):
    """Exhaustive over a stride of offsets of one shard (hypothesis samples; this sweeps)."""
    _, _, names, _ = source()
    with fresh_copy() as path:
        target = os.path.join(path, names[shard])
        original = open(target, "rb").read()
        for offset in range(0, len(original), max(1, len(original) // 97)):
            data = bytearray(original)
            data[offset] ^= 0x5A
            with open(target, "wb") as fh:
                fh.write(data)
            with pytest.raises(CorruptDatasetError, match="checksum"):
                _load(path)
        with open(target, "wb") as fh:
            fh.write(original)
        same_batch(source()[1], _load(path))
