"""NeMo-RL's ``data.train.split_validation_size`` (``data.split_validation_size`` here): a slice of
the train file held out as the validation split, the same for GRPO's prompt files, SFT's rows and
DPO's preference pairs (one reader, :func:`nrl_tasks.stages.data.file_split`): disjoint, together
the whole file, ``ceil(fraction * rows)`` held out, the same draw for the same seed."""

from __future__ import annotations

import json
import math

import pytest

from nrl_tasks.config.data import DataConfig
from nrl_tasks.stages.data import load_prompt_records
from nrl_tasks.stages.preferences import load_preferences
from nrl_tasks.stages.sft import load_sft_records


def _file(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


ROWS = {
    "prompts": (load_prompt_records, [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(40)]),
    "sft": (load_sft_records, [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
                               for i in range(40)]),
    "pairs": (load_preferences, [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(40)]),
}


@pytest.mark.parametrize("kind", sorted(ROWS))
def test_the_held_out_slice_and_the_rest_split_the_train_file(kind, tmp_path):
    load, rows = ROWS[kind]
    data = DataConfig(dataset="file", train_path=_file(tmp_path, rows), split_validation_size=0.1, split_seed=3)
    train, val = load(data, "train", 0), load(data, "val", 0)
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    assert len(val) == math.ceil(0.1 * len(rows)) == 4 and len(train) == len(rows) - 4
    assert not {key(r) for r in train} & {key(r) for r in val}
    assert sorted(map(key, train + val)) == sorted(map(key, load(data.model_copy(update={"split_validation_size": 0.0}), "train", 0)))
    assert load(data, "val", 99) == val  # split_seed, not the run's seed, draws it
    other = load(data.model_copy(update={"split_seed": 4}), "val", 0)
    assert other != val


def test_the_same_draw_for_every_reader(tmp_path):
    """The held-out row indices depend on the row count and seed only: the three readers hold out
    the same positions of files of the same length."""
    picked = {}
    for kind, (load, rows) in ROWS.items():
        data = DataConfig(dataset="file", train_path=_file(tmp_path, rows), split_validation_size=0.1, split_seed=3)
        all_rows = load(data.model_copy(update={"split_validation_size": 0.0}), "train", 0)
        val = load(data, "val", 0)
        picked[kind] = sorted(all_rows.index(r) for r in val)
    assert len({tuple(v) for v in picked.values()}) == 1, picked
