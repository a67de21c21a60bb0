"""Failure modes of the batch store: refusals, corruption, crashes, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from storage import (
    AlreadyCommittedError,
    CorruptDatasetError,
    MissingShardError,
    NotCommittedError,
    is_committed,
    list_batches,
    load_batch,
    read_manifest,
    save_batch,
)
from storage import store as store_mod
from tests.storage.helpers import same_batch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def batch_of(rows: int = 8, value: int = 0) -> dict:
    return {
        "input_ids": torch.arange(rows * 4).reshape(rows, 4) + value,
        "logprobs": torch.full((rows, 4), float(value), dtype=torch.bfloat16),
        "text": [f"{value}-{i}" for i in range(rows)],
    }


def test_overwrite_refused_unless_asked(tmp_path):
    uri = str(tmp_path / "ds")
    save_batch(batch_of(value=1), uri, num_shards=4)
    with pytest.raises(FileExistsError, match="already a committed") as err:
        save_batch(batch_of(value=2), uri)
    assert uri in str(err.value) and isinstance(err.value, AlreadyCommittedError)
    same_batch(batch_of(value=1), load_batch(uri))  # untouched
    save_batch(batch_of(rows=3, value=2), uri, num_shards=1, overwrite=True)
    same_batch(batch_of(rows=3, value=2), load_batch(uri))
    assert sorted(os.listdir(uri)) == ["_manifest.json", "part-00000.arrow"]  # old shards gone


def test_bad_input_raises_before_touching_a_committed_dataset(tmp_path):
    uri = tmp_path / "ds"
    save_batch(batch_of(value=1), uri)
    bad = {**batch_of(value=2), "text": ["too", "short"]}
    with pytest.raises(ValueError, match="text"):
        save_batch(bad, uri, overwrite=True)
    same_batch(batch_of(value=1), load_batch(uri))


def test_missing_manifest_is_not_committed(tmp_path):
    with pytest.raises(NotCommittedError, match="not committed") as err:
        load_batch(tmp_path / "never")
    assert str(tmp_path / "never") in str(err.value)
    assert isinstance(err.value, FileNotFoundError)
    with pytest.raises(FileNotFoundError, match="not committed"):
        read_manifest(tmp_path / "never")
    assert not is_committed(tmp_path / "never")


def test_missing_shard_names_the_file(tmp_path):
    save_batch(batch_of(), tmp_path / "ds", num_shards=3)
    os.unlink(tmp_path / "ds" / "part-00001.arrow")
    with pytest.raises(MissingShardError, match="part-00001.arrow"):
        load_batch(tmp_path / "ds")
    with pytest.raises(FileNotFoundError, match="part-00001.arrow"):
        load_batch(tmp_path / "ds", verify=False)
    assert load_batch(tmp_path / "ds", shard=0).size == 3  # other shards still load alone


@pytest.mark.parametrize("verify", [True, "size", False])
def test_truncated_shard_names_the_file(tmp_path, verify):
    save_batch(batch_of(), tmp_path / "ds", num_shards=2)
    path = tmp_path / "ds" / "part-00001.arrow"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptDatasetError, match="part-00001.arrow"):
        load_batch(tmp_path / "ds", verify=verify)


@pytest.mark.parametrize("mmap", [True, False])
def test_flipped_byte_fails_the_checksum(tmp_path, mmap):
    save_batch(batch_of(), tmp_path / "ds", num_shards=2)
    path = tmp_path / "ds" / "part-00000.arrow"
    data = bytearray(path.read_bytes())
    needle = (torch.arange(16) + 0).numpy().tobytes()[8:16]  # an input_ids value
    at = bytes(data).find(needle)
    assert at > 0
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptDatasetError, match=r"part-00000\.arrow.*checksum"):
        load_batch(tmp_path / "ds", mmap=mmap)
    # 'size' does not hash: documented trade-off, the flip goes through
    assert load_batch(tmp_path / "ds", verify="size")["input_ids"][0, 1].item() == 0


def test_tampered_manifest_is_rejected(tmp_path):
    save_batch(batch_of(), tmp_path / "ds", num_shards=2)
    mpath = tmp_path / "ds" / "_manifest.json"
    good = json.loads(mpath.read_text())
    for tamper in (
        lambda m: m["shards"][0].update(name="../../etc/passwd"),
        lambda m: m.update(rows=99),
        lambda m: m.update(format_version=99),
        lambda m: m["shards"].pop(),
    ):
        m = json.loads(json.dumps(good))
        tamper(m)
        mpath.write_text(json.dumps(m))
        with pytest.raises(CorruptDatasetError, match="_manifest.json"):
            load_batch(tmp_path / "ds")
    mpath.write_text("{not json")
    with pytest.raises(CorruptDatasetError, match="_manifest.json"):
        read_manifest(tmp_path / "ds")


def test_shard_swapped_for_another_valid_file(tmp_path):
    save_batch(batch_of(rows=4), tmp_path / "a")
    save_batch(batch_of(rows=6), tmp_path / "b")
    os.replace(tmp_path / "b" / "part-00000.arrow", tmp_path / "a" / "part-00000.arrow")
    with pytest.raises(CorruptDatasetError, match="part-00000.arrow"):
        load_batch(tmp_path / "a", verify=False)  # row count vs manifest still caught


def test_failure_before_the_manifest_leaves_nothing_loadable(tmp_path, monkeypatch):
    uri = tmp_path / "ds"

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash before the commit")

    monkeypatch.setattr(store_mod.sfs, "create_only", boom)  # the manifest's create-only write
    with pytest.raises(RuntimeError, match="simulated"):
        save_batch(batch_of(), uri, num_shards=3)
    assert [n for n in os.listdir(uri) if n.endswith(".arrow")] == []  # a failed writer removes its own
    with pytest.raises(NotCommittedError):
        load_batch(uri)
    assert list_batches(tmp_path) == []
    monkeypatch.undo()
    save_batch(batch_of(value=5), uri, num_shards=2)  # a retry needs no overwrite
    same_batch(batch_of(value=5), load_batch(uri))
    assert sorted(os.listdir(uri)) == ["_manifest.json", "part-00000.arrow", "part-00001.arrow"]


def _run_and_die_after_shards(uri: str, shards_before_death: int, num_shards: int, overwrite: bool) -> int:
    """Run save_batch in a child process that is killed (os._exit) mid-write."""
    script = textwrap.dedent(
        f"""
        import os, torch
        import storage.commit as st  # save_batch's module: it calls write_local by this name
        from storage.shard_io import write_local as real
        done = []
        def dying_write(*args, **kwargs):
            if len(done) == {shards_before_death}:
                os._exit(9)   # the process dies: no cleanup, no exception handlers
            done.append(1)
            return real(*args, **kwargs)
        st.write_local = dying_write
        batch = {{"x": torch.arange(40).reshape(10, 4), "s": [str(i) for i in range(10)]}}
        st.save_batch(batch, {uri!r}, num_shards={num_shards}, overwrite={overwrite})
        """
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, timeout=120).returncode


def test_killed_overwrite_leaves_nothing_that_loads(tmp_path):
    """A writer process killed mid-overwrite: old dataset uncommitted, new one never committed."""
    uri = str(tmp_path / "ds")
    save_batch(batch_of(), uri, num_shards=4)
    assert _run_and_die_after_shards(uri, shards_before_death=1, num_shards=2, overwrite=True) == 9
    assert sorted(n for n in os.listdir(uri) if not n.startswith(".")) == ["part-00000.arrow"]
    with pytest.raises(NotCommittedError):
        load_batch(uri)
    assert not is_committed(uri) and list_batches(tmp_path) == []
    save_batch(batch_of(value=4), uri)  # the retry needs no overwrite and cleans up
    same_batch(batch_of(value=4), load_batch(uri))


def test_leftover_temp_files_are_ignored_and_cleaned(tmp_path):
    uri = tmp_path / "ds"
    save_batch(batch_of(), uri, num_shards=2)
    (uri / ".part-00000.arrow.tmp-deadbeef0000").write_bytes(b"half a shard")
    (uri / "._manifest.json.tmp-deadbeef0001").write_text('{"half": ')
    same_batch(batch_of(), load_batch(uri))
    assert len(list_batches(tmp_path)) == 1
    save_batch(batch_of(value=3), uri, num_shards=2, overwrite=True)
    assert not [n for n in os.listdir(uri) if n.startswith(".")]


def test_bad_arguments(tmp_path):
    uri = tmp_path / "ds"
    with pytest.raises(ValueError, match="num_shards"):
        save_batch(batch_of(), uri, num_shards=0)
    with pytest.raises(ValueError, match=r"'b'.*|'a'.*"):
        save_batch({"a": torch.zeros(3), "b": [1, 2]}, uri)
    with pytest.raises(TypeError, match="'arr'"):
        save_batch({"arr": np.zeros(3)}, uri)
    with pytest.raises(ValueError, match="'scalar'"):
        save_batch({"scalar": torch.tensor(1.0)}, uri)
    with pytest.raises(TypeError, match=r"'vals' row 1 .*numpy"):
        save_batch({"vals": [1.0, np.float64(2.0)]}, uri)
    with pytest.raises(TypeError, match="'obj' row 0"):
        save_batch({"obj": [object()]}, uri)
    with pytest.raises(TypeError, match="meta 'when'"):
        save_batch(batch_of(), uri, when=object())
    with pytest.raises(TypeError, match="column names"):
        save_batch({1: [1]}, uri)
    assert not uri.exists()  # nothing written by any of the above
    save_batch(batch_of(), uri, num_shards=2)
    with pytest.raises(ValueError, match=r"shard must be .*\[0, 2\)"):
        load_batch(uri, shard=2)
    with pytest.raises(ValueError, match="verify"):
        load_batch(uri, verify="sometimes")
    with pytest.raises(ValueError, match="nope"):
        load_batch(uri, columns=["nope"])


def _count_fsyncs(monkeypatch) -> list[int]:
    """Spy on os.fsync (the real call still runs); returns the list of fds synced."""
    synced: list[int] = []
    real = os.fsync

    def spy(fd):
        synced.append(fd)
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return synced


def test_save_fsyncs_shards_manifest_and_directory(tmp_path, monkeypatch):
    synced = _count_fsyncs(monkeypatch)
    save_batch(batch_of(), tmp_path / "ds", num_shards=3)
    # 3 shard files, the directory once before the commit, the manifest file, the directory after it
    assert len(synced) == 6
    same_batch(batch_of(), load_batch(tmp_path / "ds"))


def test_save_without_fsync_is_still_atomic_and_loads(tmp_path, monkeypatch):
    synced = _count_fsyncs(monkeypatch)
    uri = tmp_path / "ds"
    save_batch(batch_of(value=1), uri, num_shards=2, fsync=False)
    save_batch(batch_of(value=2), uri, num_shards=3, fsync=False, overwrite=True)
    assert synced == []
    assert read_manifest(uri).meta == {}  # fsync is an option, not a meta key
    same_batch(batch_of(value=2), load_batch(uri))
    assert sorted(n for n in os.listdir(uri) if not n.startswith(".")) == [
        "_manifest.json", "part-00000.arrow", "part-00001.arrow", "part-00002.arrow"
    ]
