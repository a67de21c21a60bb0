"""Filesystem helpers on local disk (their S3 side is exercised in test_s3.py)."""

from __future__ import annotations

import os

import pytest
from fsspec.implementations.local import LocalFileSystem

from storage import fs as sfs


def test_uri_helpers():
    assert sfs.is_s3("s3://b/k") and not sfs.is_s3("/tmp/x") and not sfs.is_s3("file:///x")
    assert sfs.is_local("/tmp/x") and sfs.is_local("file:///tmp/x") and not sfs.is_local("s3://b")
    assert sfs.join("s3://b/run/", "/steps/", "step_000001") == "s3://b/run/steps/step_000001"
    assert sfs.join("file:///tmp/a", "b") == "file:///tmp/a/b"
    assert sfs.join("s3://b", "") == "s3://b"
    fs, path = sfs.resolve("file:///tmp/some/dir/")
    assert isinstance(fs, LocalFileSystem) and path == "/tmp/some/dir"
    fs, path = sfs.resolve("relative/dir")
    assert path == os.path.abspath("relative/dir")
    with pytest.raises(ValueError):
        sfs.resolve("")
    assert sfs.is_temp_name(".config.yaml.tmp-0123abcd") and not sfs.is_temp_name("config.yaml")


def test_write_atomic_replaces_and_leaves_no_temp(tmp_path):
    target = tmp_path / "a" / "b" / "metrics.json"
    sfs.write_text_atomic(str(target), "one")
    sfs.write_bytes_atomic(f"file://{target}", b"two")
    assert sfs.read_text(str(target)) == "two" and sfs.read_bytes(str(target)) == b"two"
    assert os.listdir(target.parent) == ["metrics.json"]


def test_failed_atomic_write_keeps_old_content(tmp_path, monkeypatch):
    target = tmp_path / "config.yaml"
    sfs.write_text_atomic(str(target), "old")

    def no_replace(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(sfs.os, "replace", no_replace)
    with pytest.raises(OSError, match="simulated"):
        sfs.write_text_atomic(str(target), "new")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["config.yaml"]  # the temp file was removed


def test_exists_list_dir_remove(tmp_path):
    root = str(tmp_path / "run")
    sfs.write_text_atomic(sfs.join(root, "b.txt"), "b")
    sfs.write_text_atomic(sfs.join(root, "a", "x.txt"), "x")
    (tmp_path / "run" / ".c.txt.tmp-0000aaaa").write_text("half")
    assert sfs.exists(root) and sfs.exists(sfs.join(root, "a", "x.txt"))
    assert not sfs.exists(sfs.join(root, "zzz"))
    assert sfs.list_dir(root) == ["a", "b.txt"]
    assert sfs.list_dir(sfs.join(root, "missing")) == []
    assert sfs.walk_files(root) == [".c.txt.tmp-0000aaaa", "a/x.txt", "b.txt"]
    with pytest.raises(IsADirectoryError):
        sfs.remove(sfs.join(root, "a"))
    sfs.remove(sfs.join(root, "a"), recursive=True)
    sfs.remove(sfs.join(root, "b.txt"))
    sfs.remove(sfs.join(root, "b.txt"))  # idempotent
    with pytest.raises(FileNotFoundError):
        sfs.remove(sfs.join(root, "b.txt"), missing_ok=False)
    assert sfs.list_dir(root) == []


def test_upload_and_download_dir_locally(tmp_path):
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(b"\x00" * 1000)
    (src / "sub" / "rng.json").write_text("{}")
    rels = sfs.upload_dir(src, f"file://{tmp_path}/remote/step_000002")
    assert rels == ["model.safetensors", "sub/rng.json"]
    got = sfs.download_dir(str(tmp_path / "remote" / "step_000002"), tmp_path / "restored")
    assert got == rels
    assert (tmp_path / "restored" / "model.safetensors").read_bytes() == b"\x00" * 1000
    assert (tmp_path / "restored" / "sub" / "rng.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "remote", "restored"]  # no staging left
    with pytest.raises(FileNotFoundError):
        sfs.download_dir(str(tmp_path / "nothing"), tmp_path / "x")
    with pytest.raises(NotADirectoryError):
        sfs.upload_dir(tmp_path / "nothing", str(tmp_path / "y"))


def test_s3_options_from_environment(monkeypatch):
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    assert sfs.s3_options() == {}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret")
    opts = sfs.s3_options()
    assert opts == {"endpoint_url": "http://127.0.0.1:2", "key": "AKIDEXAMPLE", "secret": "very-secret"}
    assert "region_name" not in opts
    explicit = sfs.s3_options({"endpoint_url": "http://127.0.0.1:3", "key": "k", "secret": "s"})
    assert explicit == {"endpoint_url": "http://127.0.0.1:3", "key": "k", "secret": "s"}
    masked = repr(sfs.mask_options({**opts, "client_kwargs": {"aws_session_token": "tok"}}))
    assert "very-secret" not in masked and "AKIDEXAMPLE" not in masked and "tok'" not in masked
    assert "http://127.0.0.1:2" in masked
