"""Round trips and API of the batch store on local disk (S3 lives in test_s3.py)."""

from __future__ import annotations

import glob
import json
import os

import pyarrow as pa
import pyarrow.dataset as pads
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from storage import (
    Manifest,
    delete_batch,
    is_committed,
    list_batches,
    load_batch,
    read_manifest,
    save_batch,
    shard_ranges,
)
from storage.checksum import available_algorithms, combine, digest
from tests.storage.helpers import ALL_DTYPES, every_kind_batch, random_tensor, same_batch, same_value

@pytest.mark.parametrize("num_shards", [1, 2, 7])
def test_every_kind_round_trips_exactly(tmp_path, num_shards):
    batch = every_kind_batch(5)
    manifest = save_batch(batch, tmp_path / "ds", num_shards=num_shards, step=3)
    assert manifest.rows == 5 and manifest.num_shards == num_shards
    loaded = load_batch(tmp_path / "ds")
    assert isinstance(loaded, BatchedDataDict)
    same_batch(batch, loaded)
    # shard i holds the rows of shard_ranges(i)
    for i, (start, stop) in enumerate(shard_ranges(5, num_shards)):
        part = load_batch(tmp_path / "ds", shard=i)
        assert part.size == stop - start
        for key in batch:
            value = batch[key]
            expected = value[start:stop]
            same_value(expected, part[key], f"shard {i} column {key!r}")


def test_column_kinds_recorded(tmp_path):
    manifest = save_batch(every_kind_batch(4), tmp_path / "ds")
    kinds = {c.name: c.kind for c in manifest.columns}
    assert kinds["input_ids"] == kinds["hidden"] == kinds["token_mask"] == "tensor"
    assert kinds["ragged"] == kinds["ragged_bf16"] == "tensor_list"
    assert kinds["text"] == kinds["ints"] == kinds["floats"] == kinds["nested"] == "arrow"
    for name in ("huge_ints", "mixed", "ragged_dicts", "tuples", "message_log", "ragged_mixed_dtypes"):
        assert kinds[name] == "json", name
    hidden = next(c for c in manifest.columns if c.name == "hidden")
    assert (hidden.dtype, hidden.shape, hidden.storage) == ("bfloat16", [2, 3], "uint16")


@pytest.mark.parametrize("rows,num_shards", [(0, 1), (0, 3), (2, 5)])
def test_empty_batches_and_empty_shards(tmp_path, rows, num_shards):
    batch = BatchedDataDict(
        {
            "x": torch.zeros(rows, 3, dtype=torch.bfloat16),
            "s": [str(i) for i in range(rows)],
            "r": [torch.arange(i) for i in range(rows)],
        }
    )
    m = save_batch(batch, tmp_path / "ds", num_shards=num_shards)
    assert [s.rows for s in m.shards] == [b - a for a, b in shard_ranges(rows, num_shards)]
    same_batch(batch, load_batch(tmp_path / "ds"))
    for i in range(num_shards):
        assert load_batch(tmp_path / "ds", shard=i).size == m.shards[i].rows


def test_batch_without_columns(tmp_path):
    m = save_batch(BatchedDataDict({}), tmp_path / "ds")
    assert m.rows == 0 and m.columns == []
    assert dict(load_batch(tmp_path / "ds")) == {}


def test_plain_dict_and_noncontiguous_tensors(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    z = torch.complex(base, -base)
    batch = {"t": base[:, ::2], "tt": base.t().contiguous().t(), "conj": z.conj(), "neg": z.conj().imag,
             "expanded": torch.arange(3).expand(4, 3), "in_list": [z[0].conj()] * 4}
    assert batch["conj"].is_conj() and batch["neg"].is_neg()
    save_batch(batch, str(tmp_path / "ds"))
    loaded = load_batch(str(tmp_path / "ds"))
    for key in ("conj", "neg", "in_list"):  # compare values: the lazy bits are resolved on save
        batch[key] = [t.resolve_conj().resolve_neg() for t in batch[key]] if key == "in_list" else batch[key].resolve_conj().resolve_neg()
    same_batch(batch, loaded)


def test_manifest_contents(tmp_path):
    batch = every_kind_batch(6)
    m = save_batch(batch, tmp_path / "ds", 3, run_id="r1", step=7, stage="rollouts", weights_version=7)
    on_disk = json.loads((tmp_path / "ds" / "_manifest.json").read_text())
    assert on_disk["meta"] == {"run_id": "r1", "step": 7, "stage": "rollouts", "weights_version": 7}
    read = read_manifest(tmp_path / "ds")
    assert isinstance(read, Manifest) and read.uri == str(tmp_path / "ds")
    assert read.model_dump(exclude={"uri"}) == m.model_dump(exclude={"uri"})
    assert read.column_names == list(batch.keys())
    assert read.created_at.tzinfo is not None
    for info in read.shards:
        data = (tmp_path / "ds" / info.name).read_bytes()
        assert len(data) == info.bytes
        assert digest(data, read.checksum_algorithm) == info.checksum
    assert read.checksum == combine(s.checksum for s in read.shards)
    assert read.summary()["step"] == 7 and read.summary()["rows"] == 6


@pytest.mark.parametrize("algorithm", available_algorithms())
def test_checksum_algorithms(tmp_path, monkeypatch, algorithm):
    monkeypatch.setenv("NRL_STORAGE_CHECKSUM", algorithm)
    batch = every_kind_batch(3)
    m = save_batch(batch, tmp_path / "ds", 2)
    assert m.checksum_algorithm == algorithm
    monkeypatch.delenv("NRL_STORAGE_CHECKSUM")
    same_batch(batch, load_batch(tmp_path / "ds"))


def _mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process, from /proc/self/maps."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else None
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_mmap_tensors_are_zero_copy_and_copy_on_write(tmp_path):
    batch = {"x": torch.arange(1000, dtype=torch.int64).reshape(100, 10), "bf": torch.ones(100, 4).bfloat16()}
    save_batch(batch, tmp_path / "ds")
    a = load_batch(tmp_path / "ds")
    b = load_batch(tmp_path / "ds")
    # zero-copy: the tensors' memory lies inside a mapping of the shard file
    shard_path = str(tmp_path / "ds" / "part-00000.arrow")
    for t in (a["x"], a["bf"]):
        assert _mapped_file(t.data_ptr()) == shard_path
    a["x"].add_(1)  # in place: writable, private to this mapping
    a["bf"].mul_(3)
    assert torch.equal(b["x"], batch["x"]) and torch.equal(b["bf"], batch["bf"])
    same_batch(batch, load_batch(tmp_path / "ds"))  # the file is unchanged
    c = load_batch(tmp_path / "ds", copy=True)
    c["x"].zero_()
    same_batch(batch, load_batch(tmp_path / "ds", mmap=False))


def test_columns_subset_and_verify_modes(tmp_path):
    batch = every_kind_batch(4)
    save_batch(batch, tmp_path / "ds", 2)
    sub = load_batch(tmp_path / "ds", columns=["text", "input_ids"])
    assert list(sub.keys()) == ["text", "input_ids"]
    same_value(batch["input_ids"], sub["input_ids"])
    for verify in (True, False, "full", "size", "none"):
        same_batch(batch, load_batch(tmp_path / "ds", verify=verify))


def test_readable_by_pyarrow_dataset(tmp_path):
    batch = {
        "input_ids": torch.arange(12).reshape(4, 3),
        "logprobs": torch.linspace(-1, 0, 4),
        "prompt": ["a", "b", "c", "d"],
        "ragged": [torch.arange(i, dtype=torch.int32) for i in range(4)],
        "log": [{"role": "user"}, {"role": "x", "k": (1,)}, None, {"role": "y"}],
    }
    save_batch(batch, tmp_path / "ds", num_shards=3)
    files = sorted(glob.glob(str(tmp_path / "ds" / "*.arrow")))
    assert len(files) == 3
    table = pads.dataset(files, format="arrow").to_table()
    assert table.num_rows == 4
    assert table.column("input_ids").to_pylist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert table.column("prompt").to_pylist() == ["a", "b", "c", "d"]
    assert table.column("ragged").to_pylist() == [[], [0], [0, 1], [0, 1, 2]]
    assert table.schema.field("ragged").type == pa.list_(pa.int32())
    assert table.schema.field("input_ids").metadata[b"nrl.kind"] == b"tensor"
    logs = table.column("log").to_pylist()
    assert json.loads(logs[0]) == {"role": "user"} and logs[2] is None
    assert pytest.approx(table.column("logprobs").to_pylist()) == batch["logprobs"].tolist()


def test_list_batches_finds_committed_datasets_recursively(tmp_path):
    run = tmp_path / "run"
    for step in (2, 1):
        for stage in ("rollouts", "logprobs"):
            save_batch({"x": torch.arange(step)}, run / "steps" / f"step_{step:06d}" / stage, step=step, stage=stage)
    (run / "steps" / "step_000003" / "rollouts").mkdir(parents=True)  # uncommitted
    (run / "steps" / "step_000003" / "rollouts" / "part-00000.arrow").write_bytes(b"junk")
    (run / "config.yaml").write_text("a: 1\n")
    found = list_batches(run)
    rel = [os.path.relpath(m.uri, run) for m in found]
    assert rel == [
        "steps/step_000001/logprobs", "steps/step_000001/rollouts",
        "steps/step_000002/logprobs", "steps/step_000002/rollouts",
    ]
    assert [m.meta["step"] for m in found] == [1, 1, 2, 2]
    assert load_batch(found[-1].uri)["x"].tolist() == [0, 1]
    assert [m.uri for m in list_batches(f"file://{run}/steps/step_000002")] == [
        f"file://{run}/steps/step_000002/logprobs", f"file://{run}/steps/step_000002/rollouts",
    ]
    ds = run / "steps" / "step_000001" / "rollouts"
    assert [m.uri for m in list_batches(ds)] == [str(ds)]  # a dataset prefix lists itself
    assert list_batches(tmp_path / "nowhere") == []


def test_delete_batch_is_idempotent_and_keeps_foreign_files(tmp_path):
    save_batch({"x": torch.arange(4)}, tmp_path / "ds", 2)
    assert is_committed(tmp_path / "ds")
    delete_batch(tmp_path / "ds")
    assert not is_committed(tmp_path / "ds") and not (tmp_path / "ds").exists()
    delete_batch(tmp_path / "ds")
    save_batch({"x": torch.arange(4)}, tmp_path / "ds2")
    (tmp_path / "ds2" / "notes.txt").write_text("mine")
    delete_batch(tmp_path / "ds2")
    assert os.listdir(tmp_path / "ds2") == ["notes.txt"]


# --------------------------------------------------------------------------- property test
_names = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=5), st.binary(max_size=4),
)
_nested = st.recursive(
    _json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.text(max_size=3), inner, max_size=3),
        st.tuples(inner, inner),
    ),
    max_leaves=6,
)


@st.composite
def batches(draw):
    rows = draw(st.integers(0, 6))
    cols = {}
    for name in draw(st.lists(_names, min_size=1, max_size=4, unique=True)):
        kind = draw(st.sampled_from(["tensor", "scalars", "nested", "ragged", "nested_tensors"]))
        seed = draw(st.integers(0, 10_000))
        if kind == "tensor":
            dtype = draw(st.sampled_from(ALL_DTYPES))
            inner = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
            cols[name] = random_tensor((rows, *inner), dtype, seed)
        elif kind == "scalars":
            leaf = draw(st.sampled_from([
                st.text(max_size=8), st.integers(-(2**63), 2**63 - 1), st.floats(), st.booleans(),
            ]))
            cols[name] = draw(st.lists(st.one_of(st.none(), leaf), min_size=rows, max_size=rows))
        elif kind == "nested":
            cols[name] = draw(st.lists(_nested, min_size=rows, max_size=rows))
        elif kind == "ragged":
            dtype = draw(st.sampled_from(ALL_DTYPES))
            trailing = tuple(draw(st.lists(st.integers(1, 2), max_size=1)))
            lens = draw(st.lists(st.one_of(st.none(), st.integers(0, 4)), min_size=rows, max_size=rows))
            cols[name] = [None if n is None else random_tensor((n, *trailing), dtype, seed + i)
                          for i, n in enumerate(lens)]
        else:
            cols[name] = [
                {"role": "user", "ids": random_tensor((i % 3,), torch.int64, seed + i)} for i in range(rows)
            ]
    return BatchedDataDict(cols), draw(st.integers(1, 4))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=batches())
def test_random_batches_round_trip(tmp_path, case):
    batch, num_shards = case
    uri = tmp_path / "prop"
    save_batch(batch, uri, num_shards=num_shards, overwrite=True)
    same_batch(batch, load_batch(uri))
    ranges = shard_ranges(batch.size, num_shards)
    shard = num_shards - 1
    start, stop = ranges[shard]
    part = load_batch(uri, shard=shard, mmap=False)
    for key, value in batch.items():
        same_value(value[start:stop], part[key], f"shard {shard} column {key!r}")
