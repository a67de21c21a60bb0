"""Forged data: bounded decoding, exact JSON tensor payloads, and write errors naming the URI."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest
import torch

from storage import CorruptDatasetError, load_batch, save_batch
from storage import shard_io
from storage.checksum import combine, digest
from storage.pycodec import decode_json

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def forge_shard(uri: str, table: pa.Table, compression: str | None = None) -> str:
    """Replace shard 0 of a one-shard dataset by ``table`` and fix the manifest to match, as
    a forger would: sizes and checksums all agree, so only the content can give it away."""
    path = os.path.join(uri, "part-00000.arrow")
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_table(table)
    raw = sink.getvalue().to_pybytes()
    with open(path, "wb") as f:
        f.write(raw)
    mpath = os.path.join(uri, "_manifest.json")
    with open(mpath, encoding="utf-8") as f:
        manifest = json.load(f)
    shard = manifest["shards"][0]
    shard.update(bytes=len(raw), checksum=digest(raw, manifest["checksum_algorithm"]), rows=table.num_rows)
    manifest["rows"] = table.num_rows
    manifest["checksum"] = combine([shard["checksum"]])
    with open(mpath, "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    return path


def test_compressed_shard_refused_before_allocating(tmp_path):
    """A few KB of zstd claiming 64 MB: refused from the metadata, naming the file."""
    uri = str(tmp_path / "ds")
    rows, width = 4, 16 << 20
    save_batch({"x": torch.zeros(rows, 16, dtype=torch.uint8)}, uri)
    with open(os.path.join(uri, "part-00000.arrow"), "rb") as f:
        schema = pa.ipc.open_file(f).schema  # the writer's own field tags
    field = schema.field("x")
    field = field.with_metadata({**field.metadata, b"nrl.shape": json.dumps([width]).encode()})
    values = pa.array(np.zeros(rows * width, dtype=np.uint8))
    column = pa.FixedSizeListArray.from_arrays(values, width)
    forged = pa.Table.from_arrays([column], schema=pa.schema([field.with_type(column.type)], metadata=schema.metadata))
    path = forge_shard(uri, forged, compression="zstd")
    assert os.path.getsize(path) < 100_000
    manifest = json.load(open(os.path.join(uri, "_manifest.json")))
    manifest["columns"][0]["shape"] = [width]
    manifest["columns"][0]["arrow_type"] = str(column.type)
    json.dump(manifest, open(os.path.join(uri, "_manifest.json"), "w"))
    pool = pa.default_memory_pool()
    before = pool.bytes_allocated()
    for verify in (True, "size", False):
        with pytest.raises(CorruptDatasetError, match=r"part-00000\.arrow would decode to \d+ bytes") as err:
            load_batch(uri, verify=verify)
        assert "refused before allocating" in str(err.value)
    assert pool.bytes_allocated() - before < 1 << 20


def test_honest_shards_pass_the_bound(tmp_path):
    uri = str(tmp_path / "ds")
    batch = {"x": torch.arange(1000).reshape(100, 10), "s": [f"row {i}" for i in range(100)]}
    save_batch(batch, uri, num_shards=3)
    for name in sorted(os.listdir(uri)):
        if name.endswith(".arrow"):
            with open(os.path.join(uri, name), "rb") as f:
                shard_io.check_decoded_size(f.read(), name)
    assert torch.equal(load_batch(uri)["x"], batch["x"])


@pytest.mark.parametrize(
    "payload, shape, dtype",
    [
        ("", [1_000_000], "float32"),  # empty payload: would be uninitialised memory
        ("AAAA", [4], "float32"),  # 3 bytes for 16
        ("AAAAAAAAAAAAAAAAAAAAAA==", [2], "float32"),  # 16 bytes for 8
        ("", [-1], "float32"),
        ("", "3", "int8"),
    ],
)
def test_json_tensor_payload_must_match_shape_and_dtype(payload, shape, dtype):
    row = json.dumps([{"__nrl__": "tensor", "dtype": dtype, "shape": shape, "b64": payload}])
    with pytest.raises(ValueError, match="JSON tensor"):
        decode_json([pa.array([row])])


def test_json_tensor_exact_payloads_still_decode():
    ok = json.dumps([{"__nrl__": "tensor", "dtype": "int16", "shape": [0, 3], "b64": ""},
                     {"__nrl__": "tensor", "dtype": "int16", "shape": [3], "b64": "AQACAAMA"}])
    empty, three = decode_json([pa.array([ok])])[0]
    assert empty.shape == (0, 3) and three.tolist() == [1, 2, 3]


def test_forged_json_tensor_is_a_corrupt_dataset(tmp_path):
    uri = str(tmp_path / "ds")
    save_batch({"m": [{"t": torch.ones(2)}, (1, 2)]}, uri)  # a JSON column
    with open(os.path.join(uri, "part-00000.arrow"), "rb") as f:
        table = pa.ipc.open_file(f).read_all()
    forged_row = json.dumps({"t": {"__nrl__": "tensor", "dtype": "float64", "shape": [1 << 20], "b64": ""}})
    column = pa.array([forged_row, table.column("m").to_pylist()[1]], type=table.schema.field("m").type)
    forge_shard(uri, pa.Table.from_arrays([column], schema=table.schema))
    with pytest.raises(CorruptDatasetError, match=r"part-00000\.arrow column 'm' cannot be decoded.*JSON tensor"):
        load_batch(uri)


# --------------------------------------------------------------------------- write errors
def test_disk_full_names_the_dataset(tmp_path, monkeypatch):
    """ENOSPC while a shard is written (the far side faked): the error names the URI, keeps
    the errno and chains the original."""
    uri = str(tmp_path / "ds")

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shard_io._HashingSink, "write", full)
    with pytest.raises(OSError) as err:
        save_batch({"x": torch.arange(10)}, uri)
    assert err.value.errno == errno.ENOSPC and uri in str(err.value) and "No space left" in str(err.value)
    assert isinstance(err.value.__cause__, OSError) and err.value.__cause__.errno == errno.ENOSPC
    assert not [n for n in os.listdir(uri) if not n.startswith("._")]  # nothing left that could load


def test_manifest_write_failure_names_the_dataset(tmp_path, monkeypatch):
    from storage import store as store_mod

    uri = str(tmp_path / "ds")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(uri, "._manifest.json.tmp-x"))

    monkeypatch.setattr(store_mod.sfs, "create_only", full)
    with pytest.raises(OSError, match=rf"save_batch to {uri} failed: No space left on device \(.*_manifest"):
        save_batch({"x": torch.arange(10)}, uri, num_shards=2)
    assert os.listdir(uri) == []  # the failed writer removed its shards


def test_real_write_limit_names_the_dataset(tmp_path):
    """A real failing write (RLIMIT_FSIZE in a child: the kernel refuses with EFBIG)."""
    uri = str(tmp_path / "ds")
    script = textwrap.dedent(
        f"""
        import errno, resource, signal, sys, torch
        from storage import save_batch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        try:
            save_batch({{"x": torch.zeros(1 << 20, dtype=torch.uint8)}}, {uri!r})
        except OSError as exc:
            ok = exc.errno == errno.EFBIG and {uri!r} in str(exc) and isinstance(exc.__cause__, OSError)
            print("named" if ok else f"unnamed: {{exc!r}}")
            sys.exit(0)
        print("no error")
        """
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "named", (out.stdout, out.stderr[-2000:])
