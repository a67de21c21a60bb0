"""The batch store and fs helpers through s3fs against real S3 servers on 127.0.0.1.

``moto_s3`` (moto's server) for everything; ``seaweed_s3`` (SeaweedFS ``weed mini``) for the
integration cases marked by the ``server`` parameter.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from storage import (
    AlreadyCommittedError,
    CorruptDatasetError,
    MissingShardError,
    NotCommittedError,
    delete_batch,
    download_dir,
    exists,
    is_committed,
    join,
    list_batches,
    list_dir,
    load_batch,
    read_manifest,
    read_text,
    remove,
    save_batch,
    upload_dir,
    write_text_atomic,
)
from storage.fs import walk_files
from storage import store as store_mod
from tests.storage.helpers import every_kind_batch, same_batch, same_value

pytestmark = pytest.mark.s3
SERVERS = ["moto_s3", "seaweed_s3"]


@pytest.fixture(params=SERVERS)
def server(request):
    return request.getfixturevalue(request.param)


@pytest.fixture
def root(server) -> str:
    """A fresh prefix in one shared bucket (SeaweedFS makes new buckets slowly)."""
    return f"{server.make_bucket('nrl-storage-tests')}/{uuid.uuid4().hex[:10]}"


def test_round_trip_and_shards(server, root):
    uri = f"{root}/run/steps/step_000001/rollouts"
    batch = every_kind_batch(6)
    m = save_batch(batch, uri, num_shards=3, storage_options=server.storage_options, step=1)
    assert m.uri == uri and m.rows == 6
    same_batch(batch, load_batch(uri, storage_options=server.storage_options))
    part = load_batch(uri, shard=1, storage_options=server.storage_options)
    for key, value in batch.items():
        same_value(value[2:4], part[key], key)
    # tensors from S3 are writable private copies
    part["input_ids"].add_(1)
    same_value(batch["input_ids"], load_batch(uri, storage_options=server.storage_options)["input_ids"])


def test_commit_semantics(server, root):
    opts = server.storage_options
    uri = f"{root}/ds"
    with pytest.raises(NotCommittedError, match="not committed"):
        load_batch(uri, storage_options=opts)
    assert not is_committed(uri, opts)
    save_batch({"x": torch.arange(10)}, uri, num_shards=2, storage_options=opts)
    assert is_committed(uri, opts)
    with pytest.raises(AlreadyCommittedError, match=uri):
        save_batch({"x": torch.arange(3)}, uri, storage_options=opts)
    save_batch({"x": torch.arange(3)}, uri, overwrite=True, storage_options=opts)
    assert load_batch(uri, storage_options=opts)["x"].tolist() == [0, 1, 2]
    assert list_dir(uri, opts) == ["_manifest.json", "part-00000.arrow"]
    assert [m.uri for m in list_batches(uri, opts)] == [uri]
    delete_batch(uri, opts)
    assert not is_committed(uri, opts) and walk_files(uri, opts) == []


def test_list_batches_under_a_run(server, root):
    opts = server.storage_options
    run = f"{root}/run-7"
    for step in (1, 2):
        save_batch({"x": torch.arange(step)}, join(run, f"steps/step_{step:06d}/rollouts"),
                   storage_options=opts, step=step)
    server.filesystem().pipe_file(f"{run[5:]}/steps/step_000003/rollouts/part-00000.arrow", b"uncommitted")
    found = list_batches(run, opts)
    assert [m.uri for m in found] == [
        f"{run}/steps/step_000001/rollouts", f"{run}/steps/step_000002/rollouts"
    ]
    assert [m.meta["step"] for m in found] == [1, 2]


def test_fs_helpers_on_s3(server, root, tmp_path):
    opts = server.storage_options
    root = f"{root}/run"
    write_text_atomic(join(root, "config.yaml"), "lr: 1.0e-6\n", opts)
    write_text_atomic(join(root, "config.yaml"), "lr: 2.0e-6\n", opts)
    assert read_text(join(root, "config.yaml"), opts) == "lr: 2.0e-6\n"
    assert exists(join(root, "config.yaml"), opts) and not exists(join(root, "nope"), opts)
    ckpt = tmp_path / "ckpt"
    (ckpt / "optim").mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(bytes(range(256)) * 100)
    (ckpt / "optim" / "state.pt").write_bytes(b"x" * 10)
    assert upload_dir(ckpt, join(root, "checkpoints/step_000002"), opts) == [
        "model.safetensors", "optim/state.pt"
    ]
    assert list_dir(join(root, "checkpoints"), opts) == ["step_000002"]
    assert list_dir(root, opts) == ["checkpoints", "config.yaml"]
    download_dir(join(root, "checkpoints/step_000002"), tmp_path / "back", opts)
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == bytes(range(256)) * 100
    assert (tmp_path / "back" / "optim" / "state.pt").read_bytes() == b"x" * 10
    with pytest.raises(IsADirectoryError):
        remove(join(root, "checkpoints"), storage_options=opts)
    remove(join(root, "checkpoints"), recursive=True, storage_options=opts)
    remove(join(root, "config.yaml"), storage_options=opts)
    remove(join(root, "config.yaml"), storage_options=opts)  # idempotent
    assert walk_files(root, opts) == []
    # (SeaweedFS keeps emptied directories, as a local disk does; plain S3 forgets the prefix)
    assert list_dir(root, opts) in ([], ["checkpoints"])


def test_corruption_detected_on_s3(server, root):
    opts = server.storage_options
    uri = f"{root}/ds"
    save_batch({"x": torch.arange(64).reshape(8, 8)}, uri, num_shards=2, storage_options=opts)
    raw_fs = server.filesystem()
    key = f"{uri[5:]}/part-00001.arrow"
    data = bytearray(raw_fs.cat_file(key))
    data[len(data) // 2] ^= 0xFF
    raw_fs.pipe_file(key, bytes(data))
    with pytest.raises(CorruptDatasetError, match="part-00001.arrow"):
        load_batch(uri, storage_options=opts)
    raw_fs.pipe_file(key, bytes(data[:100]))
    with pytest.raises(CorruptDatasetError, match="part-00001.arrow.*bytes"):
        load_batch(uri, storage_options=opts, verify="size")
    raw_fs.rm(key)
    with pytest.raises(MissingShardError, match="part-00001.arrow"):
        load_batch(uri, storage_options=opts)


# --------------------------------------------------------------------------- moto only
def test_environment_configuration(moto_s3, monkeypatch):
    for name, value in moto_s3.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    uri = f"{moto_s3.make_bucket()}/from-env"
    save_batch({"x": torch.ones(2, 2)}, uri)  # no storage_options: AWS_* variables
    assert load_batch(uri)["x"].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert read_manifest(uri).rows == 2


def test_writes_by_others_are_seen_despite_listing_caches(moto_s3):
    opts = moto_s3.storage_options
    run = f"{moto_s3.make_bucket()}/run"
    save_batch({"x": torch.arange(2)}, join(run, "a"), storage_options=opts)
    assert len(list_batches(run, opts)) == 1 and list_dir(run, opts) == ["a"]  # caches warm
    # another process (a separate client) commits a dataset and deletes one
    other = moto_s3.filesystem()
    save_batch({"x": torch.arange(3)}, join(run, "b"), storage_options={**opts, "skip_instance_cache": True})
    assert list_dir(run, opts) == ["a", "b"]
    assert is_committed(join(run, "b"), opts)
    assert [m.uri for m in list_batches(run, opts)] == [join(run, "a"), join(run, "b")]
    other.rm(f"{run[5:]}/a/_manifest.json")
    assert not is_committed(join(run, "a"), opts)
    assert [m.uri for m in list_batches(run, opts)] == [join(run, "b")]
    with pytest.raises(NotCommittedError):
        load_batch(join(run, "a"), storage_options=opts)


def test_failure_before_manifest_on_s3(moto_s3, monkeypatch):
    opts = moto_s3.storage_options
    uri = f"{moto_s3.make_bucket()}/ds"
    save_batch({"x": torch.arange(4)}, uri, storage_options=opts)

    real = store_mod.sfs.create_only

    def boom(target, *args, **kwargs):
        if str(target).endswith("_manifest.json"):
            raise ConnectionError("simulated crash before the commit")
        return real(target, *args, **kwargs)

    monkeypatch.setattr(store_mod.sfs, "create_only", boom)
    with pytest.raises(ConnectionError, match=f"{uri}.*simulated"):
        save_batch({"x": torch.arange(9)}, uri, num_shards=3, overwrite=True, storage_options=opts)
    monkeypatch.undo()
    assert list_dir(uri, opts) == []  # old dataset uncommitted and deleted; the failed writer removed its shards
    with pytest.raises(NotCommittedError):
        load_batch(uri, storage_options=opts)
    save_batch({"x": torch.arange(5)}, uri, storage_options=opts)  # retry: uncommitted, no overwrite
    assert load_batch(uri, storage_options=opts)["x"].tolist() == [0, 1, 2, 3, 4]
    assert list_dir(uri, opts) == ["_manifest.json", "part-00000.arrow"]


def test_credentials_never_in_errors(seaweed_s3):
    """SeaweedFS checks signatures: a wrong secret is refused, and the error shows neither."""
    uri = f"{seaweed_s3.make_bucket('nrl-storage-tests')}/creds"
    save_batch({"x": torch.arange(2)}, uri, storage_options=seaweed_s3.storage_options)
    secret, key = "sekrit-value-4242", "AKIDSEKRIT4242"
    bad = {"endpoint_url": seaweed_s3.endpoint_url, "key": key, "secret": secret}
    with pytest.raises(Exception) as err:
        load_batch(uri, storage_options=bad)
    text = f"{err.value!s} {err.value!r} {err.value.__cause__!r}"
    assert secret not in text and key not in text
