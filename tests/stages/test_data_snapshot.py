"""A run's frozen prompt snapshot keeps every field of a row (issue 41, item 8).

A multi-turn environment gets the prompt's whole data row as the episode's first metadata. A later
process of the run (a resume, an extension) reads the rows back from the run's snapshot at
``<run>/data/train``; before this fix the snapshot kept only ``prompt`` and ``answer``, so an
environment that rewarded from another column silently changed its results after a resume."""

from __future__ import annotations

import json

import storage
from flows.config import load_config
from nrl_tasks.run_layout import RunLayout, join_uri
from nrl_tasks.stages.data import read_records_snapshot, snapshot_records

ROWS = [
    {"prompt": "What is 1+1?", "answer": "2", "demonstration": [{"role": "assistant", "content": "2"}], "bonus": 3},
    {"prompt": "What is 2+3?", "answer": "5", "note": "a text column"},
    {"prompt": "Name?", "answer": "x", "bonus": 0.5, "demonstration": None},
]


def _cfg(tmp_path, **data):
    return load_config({"policy": {"model_name": "builtin:tiny", "train_global_batch_size": 4, "train_micro_batch_size": 4},
                        "generation": {"backend": "hf"}, "storage": {"root": str(tmp_path / "runs")}, "data": data}, [])


def test_a_later_process_reads_every_column_of_the_rows_the_first_one_used(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = _cfg(tmp_path, dataset="file", train_path=str(path))
    layout = RunLayout(cfg.storage.root, "r1")
    first = snapshot_records(layout, cfg, "train")  # the run's first process: loads the file, freezes it
    assert storage.is_committed(join_uri(layout.run_uri, "data", "train"))
    path.write_text("")  # the source may change or vanish: the run keeps its own copy
    later = snapshot_records(layout, cfg, "train")  # a resume: reads the snapshot back
    assert later == first
    assert later[0]["demonstration"] == json.dumps(ROWS[0]["demonstration"]) and later[0]["bonus"] == "3"
    assert later[1]["note"] == "a text column" and "bonus" not in later[1]
    assert "demonstration" not in later[2]  # a null field stays absent, as the file loader gives it


def test_the_calculator_rows_keep_their_demonstration(tmp_path):
    cfg = _cfg(tmp_path, dataset="calculator", arithmetic={"num_train": 6, "num_val": 2, "max_operand": 9, "ops": ["+"]})
    layout = RunLayout(cfg.storage.root, "calc")
    first = snapshot_records(layout, cfg, "train")
    assert all("demonstration" in r for r in first)
    assert read_records_snapshot(join_uri(layout.run_uri, "data", "train")) == first


def test_a_snapshot_written_before_the_fields_column_still_reads(tmp_path):
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

    uri = str(tmp_path / "old")
    storage.save_batch(BatchedDataDict({"prompt": ["a", "b"], "answer": ["1", "2"]}), uri, run_id="old", stage="data-train", step=0)
    assert read_records_snapshot(uri) == [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    assert read_records_snapshot(str(tmp_path / "absent")) is None
