"""Exclusive commit: concurrent writers of one dataset URI.

Property (threads and processes on local disk, threads on S3 through moto): of N writers
saving different batches to the same URI at the same moment, exactly one returns a manifest,
every other raises ``AlreadyCommittedError`` naming the URI, and the committed dataset loads
with full checksum verification as exactly the winner's batch. Leftovers of a crashed earlier
attempt (files under the plain shard names) never end up in, or break, the committed dataset.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import uuid
from typing import Any, Callable, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import AlreadyCommittedError, load_batch, read_manifest, save_batch
from storage import fs as sfs
from tests.storage.helpers import same_batch

SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def writer_batch(writer: int, rows: int) -> dict[str, Any]:
    return {
        "x": torch.full((rows, 16), writer, dtype=torch.int64),
        "ragged": [torch.arange(writer + i % 3, dtype=torch.int32) for i in range(rows)],
        "who": [f"writer {writer}"] * rows,
    }


def _save(uri: str, writer: int, rows: int, shards: int, opts: Optional[dict], same: bool = False) -> str:
    """``"won"`` or ``"lost"`` (``AlreadyCommittedError`` naming ``uri``); anything else raises.

    ``same``: every writer saves the same batch (a deterministic stage run twice): identical
    shard bytes must not make a loser think a shard file is its own.
    """
    try:
        batch = writer_batch(0 if same else writer, rows)
        save_batch(batch, uri, num_shards=shards, storage_options=opts, fsync=False, writer=writer)
    except AlreadyCommittedError as exc:
        assert uri in str(exc), exc
        return "lost"
    return "won"


def _race_threads(uri: str, plan: list[tuple[int, int]], opts: Optional[dict] = None, same: bool = False) -> list[Any]:
    barrier = threading.Barrier(len(plan))
    out: list[Any] = [None] * len(plan)

    def run(i: int) -> None:
        barrier.wait()
        try:
            out[i] = _save(uri, i, *plan[i], opts, same)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(plan))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def _process_main(uri: str, i: int, rows: int, shards: int, barrier: Any, queue: Any) -> None:
    barrier.wait()
    try:
        queue.put((i, _save(uri, i, rows, shards, None)))
    except BaseException as exc:  # noqa: BLE001
        queue.put((i, f"{type(exc).__name__}: {exc}"))


def _race_processes(uri: str, plan: list[tuple[int, int]]) -> list[Any]:
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(len(plan)), ctx.Queue()
    procs = [ctx.Process(target=_process_main, args=(uri, i, *plan[i], barrier, queue)) for i in range(len(plan))]
    for p in procs:
        p.start()
    out: list[Any] = [None] * len(plan)
    for _ in procs:
        i, result = queue.get(timeout=120)
        out[i] = result
    for p in procs:
        p.join(30)
        assert p.exitcode == 0, p.exitcode
    return out


def check_outcome(
    uri: str, plan: list[tuple[int, int]], results: list[Any], opts: Optional[dict] = None, same: bool = False
) -> None:
    assert all(r in ("won", "lost") for r in results), results
    assert results.count("won") == 1, results
    winner = results.index("won")
    manifest = read_manifest(uri, opts)
    assert manifest.meta["writer"] == winner
    expected = writer_batch(0 if same else winner, plan[winner][0])
    same_batch(expected, load_batch(uri, storage_options=opts, verify=True))
    # losers removed their files, leftovers of a crashed attempt are gone: only the dataset
    names = {n for n in sfs.list_dir(uri, opts)}
    assert names == {"_manifest.json", *(s.name for s in manifest.shards)}, sorted(names)


def _leftovers(uri: str, shards: int) -> None:
    """What a writer killed before its commit leaves: files under the plain shard names."""
    os.makedirs(uri, exist_ok=True)
    for i in range(shards):
        with open(os.path.join(uri, f"part-{i:05d}.arrow"), "wb") as f:
            f.write(b"left by a crashed attempt")
    with open(os.path.join(uri, f"._manifest.json{sfs.TMP_MARKER}deadbeef0000"), "wb") as f:
        f.write(b'{"half": ')


plans = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 3)), min_size=2, max_size=6)


@settings(max_examples=25, **SETTINGS)
@given(plan=plans, crashed_before=st.booleans())
def test_concurrent_writers_threads(tmp_path_factory, plan, crashed_before):
    uri = str(tmp_path_factory.mktemp("race") / "ds")
    if crashed_before:
        _leftovers(uri, 3)
    check_outcome(uri, plan, _race_threads(uri, plan))


@settings(max_examples=8, **SETTINGS)
@given(plan=plans, crashed_before=st.booleans())
def test_concurrent_writers_processes(tmp_path_factory, plan, crashed_before):
    uri = str(tmp_path_factory.mktemp("race") / "ds")
    if crashed_before:
        _leftovers(uri, 3)
    check_outcome(uri, plan, _race_processes(uri, plan))


@pytest.mark.s3
@settings(max_examples=8, **SETTINGS)
@given(plan=plans, same=st.booleans())
def test_concurrent_writers_s3(moto_s3, plan, same):
    opts = moto_s3.storage_options
    uri = f"{moto_s3.make_bucket('nrl-exclusive-commit')}/{uuid.uuid4().hex[:10]}/ds"
    check_outcome(uri, plan, _race_threads(uri, plan, opts, same), opts, same)


@settings(max_examples=10, **SETTINGS)
@given(rows=st.integers(1, 30), shards=st.integers(1, 3), writers=st.integers(2, 6))
def test_concurrent_writers_of_one_deterministic_batch(tmp_path_factory, rows, shards, writers):
    uri = str(tmp_path_factory.mktemp("race") / "ds")
    plan = [(rows, shards)] * writers
    check_outcome(uri, plan, _race_threads(uri, plan, same=True), same=True)


def test_loser_error_names_the_uri_and_the_winner_stands(tmp_path, monkeypatch):
    """Deterministic interleaving: writer B commits while A is between its shards and its manifest."""
    from storage import store as store_mod

    uri = str(tmp_path / "ds")
    real: Callable[..., bool] = store_mod.sfs.create_only
    done = []

    def b_commits_first(target: Any, *args: Any, **kwargs: Any) -> bool:
        if str(target).endswith("_manifest.json") and not done:
            done.append(1)
            save_batch(writer_batch(2, 5), uri, num_shards=2)  # B, all the way through
        return real(target, *args, **kwargs)

    monkeypatch.setattr(store_mod.sfs, "create_only", b_commits_first)
    with pytest.raises(AlreadyCommittedError, match=f"{uri} was committed by another writer"):
        save_batch(writer_batch(1, 7), uri, num_shards=2)  # A: shards written, manifest loses
    same_batch(writer_batch(2, 5), load_batch(uri))
    names = sorted(os.listdir(uri))
    assert names == sorted(["_manifest.json", *(s.name for s in read_manifest(uri).shards)]), names


def test_retry_after_a_crash_and_idempotent_refusal(tmp_path):
    """One writer retrying: uncommitted leftovers are replaced, a committed dataset is refused."""
    uri = str(tmp_path / "ds")
    _leftovers(uri, 2)
    m = save_batch(writer_batch(1, 4), uri, num_shards=2)
    assert all(s.name.startswith("part-0000") and s.name.endswith(".arrow") for s in m.shards)
    assert sorted(os.listdir(uri)) == sorted(["_manifest.json", *(s.name for s in m.shards)])
    with pytest.raises(AlreadyCommittedError, match="already a committed"):
        save_batch(writer_batch(2, 4), uri)
    save_batch(writer_batch(3, 2), uri, overwrite=True)
    same_batch(writer_batch(3, 2), load_batch(uri))
    assert sorted(os.listdir(uri)) == ["_manifest.json", "part-00000.arrow"]  # plain names again


@pytest.mark.s3
@pytest.mark.parametrize("writers", [2, 5])
def test_concurrent_writers_of_one_deterministic_batch_s3(moto_s3, writers):
    opts = moto_s3.storage_options
    for _ in range(3):
        uri = f"{moto_s3.make_bucket('nrl-exclusive-commit')}/{uuid.uuid4().hex[:10]}/ds"
        plan = [(12, 2)] * writers
        check_outcome(uri, plan, _race_threads(uri, plan, opts, same=True), opts, same=True)


def test_create_only_local(tmp_path):
    target = str(tmp_path / "d" / "f.json")
    assert sfs.create_only(target, b"first")
    assert not sfs.create_only(target, b"second") and not sfs.create_only(target, b"first")
    assert open(target, "rb").read() == b"first"
    assert os.listdir(tmp_path / "d") == ["f.json"]  # no temp file left


@pytest.mark.s3
def test_create_only_s3_and_a_retried_put(moto_s3):
    opts = moto_s3.storage_options
    target = f"{moto_s3.make_bucket('nrl-exclusive-commit')}/{uuid.uuid4().hex[:10]}/f.json"
    assert sfs.create_only(target, b"first", opts)
    assert not sfs.create_only(target, b"second", opts)
    assert sfs.read_bytes(target, opts) == b"first"
    # a retry of a PUT that landed meets its own bytes: created by this caller ...
    assert sfs.create_only(target, b"first", opts)
    # ... unless another caller may have written the same bytes
    assert not sfs.create_only(target, b"first", opts, equal_is_mine=False)
