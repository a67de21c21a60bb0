"""Restore verification on a real checkpoint of the tiny model: ``checkpoint.json`` lists every
file of ``weights/`` and ``optimizer/`` with size and checksum; a restore refuses a checkpoint
whose files differ (one value changed, a file or ``optimizer/`` deleted, a truncated file, an
unreadable ``checkpoint.json``) with an error naming the file, before loading anything."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.stages.checkpoint import (
    CheckpointDamagedError,
    check_checkpoint,
    discard_checkpoint,
    list_checkpoints,
    read_checkpoint_info,
    restore_checkpoint,
    save_checkpoint,
)
from nrl_tasks.stages.errors import DamagedRunError
from nrl_tasks.models.policy.workers.in_process import in_process_worker


class _OneRankPolicy:
    """The ``Policy`` checkpoint interface over one in-process worker; counts loads."""

    def __init__(self, worker) -> None:
        self.worker, self.loads = worker, 0

    def save_checkpoint(self, weights_path, optimizer_path=None, tokenizer_path=None, **_kw):
        rng = [self.worker.get_rng_state()] if optimizer_path else []
        self.worker.save_checkpoint(weights_path, optimizer_path, None, rng)

    def load_checkpoint(self, weights_path, optimizer_path=None, **_kw):
        self.loads += 1
        self.worker.load_checkpoint(weights_path, optimizer_path)

    def set_weights_version(self, version):
        self.worker.set_weights_version(version)

    def weights_checksum(self):
        return self.worker.weights_checksum()


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    cfg = PolicyConfig(model_name=tiny_model_dir, train_global_batch_size=2, train_micro_batch_size=1,
                       max_total_sequence_length=32, optimizer={"kwargs": {"lr": 1e-3}})
    with in_process_worker(cfg) as worker:
        policy = _OneRankPolicy(worker)
        root = tmp_path_factory.mktemp("ckpts")
        uri = str(root / "step_000001")
        save_checkpoint(policy, uri, {"step": 1, "weights_version": 1, "weights_checksum": policy.weights_checksum()})
        yield policy, uri


def _copy(uri: str, tmp_path) -> str:
    dst = str(tmp_path / "checkpoints" / "step_000001")
    shutil.copytree(uri, dst)
    return dst


def _flip_value(path: str) -> None:
    """Change one value of a safetensors file: a byte near the end (tensor data, not the header)."""
    with open(path, "r+b") as fh:
        fh.seek(-64, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-64, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0x01]))


def test_checkpoint_json_lists_every_file_with_size_and_checksum(saved):
    policy, uri = saved
    info = read_checkpoint_info(uri)
    files = info["files"]
    assert {"weights/model.safetensors", "weights/config.json", "optimizer/optimizer.safetensors",
            "optimizer/optimizer.json"} <= set(files)
    assert any(f.startswith("optimizer/rng/") for f in files)
    for rel, entry in files.items():
        assert entry["size"] == os.path.getsize(os.path.join(uri, rel)) and entry["checksum"], rel
    assert info["checksum_algorithm"] == "xxh3-128" and info["optimizer"] is True and info["seconds"] > 0
    assert check_checkpoint(uri) is None
    loads = policy.loads
    assert restore_checkpoint(policy, uri)["weights_version"] == 1 and policy.loads == loads + 1


@pytest.mark.parametrize(
    "damage, names, what",
    [
        ("flip weights", "weights/model.safetensors", "has checksum"),
        ("flip optimizer", "optimizer/optimizer.safetensors", "has checksum"),
        ("delete optimizer/", "optimizer/", "more of its"),
        ("truncate weights", "weights/model.safetensors", "bytes, checkpoint.json lists"),
    ],
)
def test_a_damaged_checkpoint_is_refused_before_loading_naming_the_file(saved, tmp_path, damage, names, what):
    policy, uri = saved
    ck = _copy(uri, tmp_path)
    if damage == "flip weights":
        _flip_value(os.path.join(ck, "weights", "model.safetensors"))
    elif damage == "flip optimizer":
        _flip_value(os.path.join(ck, "optimizer", "optimizer.safetensors"))
    elif damage == "delete optimizer/":
        shutil.rmtree(os.path.join(ck, "optimizer"))
    else:
        with open(os.path.join(ck, "weights", "model.safetensors"), "r+b") as fh:
            fh.truncate(1000)
    problem = check_checkpoint(ck)
    assert problem and os.path.join(ck, names) in problem and what in problem, problem
    loads = policy.loads
    with pytest.raises(CheckpointDamagedError) as err:
        restore_checkpoint(policy, ck)
    assert err.value.step == 1 and problem in str(err.value)
    assert policy.loads == loads  # nothing was loaded


def test_a_corrupt_checkpoint_json_is_named(saved, tmp_path):
    policy, uri = saved
    ck = _copy(uri, tmp_path)
    with open(os.path.join(ck, "checkpoint.json"), "w") as fh:
        fh.write('{"step": 1, "weights_')
    with pytest.raises(DamagedRunError, match=rf"{os.path.join(ck, 'checkpoint.json')} is not valid JSON"):
        read_checkpoint_info(ck)
    assert "checkpoint.json is not valid JSON" in check_checkpoint(ck)
    with pytest.raises(DamagedRunError, match="is not valid JSON"):
        restore_checkpoint(policy, ck)


def test_a_checkpoint_without_file_manifest_loads_and_a_discarded_one_is_gone(saved, tmp_path):
    policy, uri = saved
    ck = _copy(uri, tmp_path)
    info = read_checkpoint_info(ck)
    for key in ("files", "checksum_algorithm", "optimizer"):
        info.pop(key)
    with open(os.path.join(ck, "checkpoint.json"), "w") as fh:
        json.dump(info, fh)
    _flip_value(os.path.join(ck, "weights", "model.safetensors"))
    assert check_checkpoint(ck) is None  # nothing to compare with: only the weights checksum can tell
    restore_checkpoint(policy, ck)
    assert policy.weights_checksum() != info["weights_checksum"]  # what the resume executor checks
    discard_checkpoint(ck, "the weights loaded have checksum x")
    assert list_checkpoints(os.path.dirname(ck)) == []
    assert json.loads(open(os.path.join(ck, "damaged.json")).read())["problem"] == "the weights loaded have checksum x"
    restore_checkpoint(policy, uri)  # back to the intact one for the other tests
