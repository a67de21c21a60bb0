"""``flows.run.recompute``: what a resume checks and what ``--recompute STAGE@STEP`` deletes, on a
synthetic run (real Arrow datasets and checkpoint commit files, no actors): steps 1-3 trained,
a checkpoint at step 2 (the anchor), step 4 started (datasets up to advantages)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from flows.run.recompute import (
    DamagedRunError,
    apply_recompute,
    check_resume_data,
    find_damaged,
    plan_recompute,
    resume_window,
)
from nrl_tasks.run_layout import DATA_STAGES, RunLayout
from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

RUN = "synthetic"


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> RunLayout:
    import storage

    lay = RunLayout(str(tmp_path_factory.mktemp("recompute")), RUN)
    for step in (1, 2, 3, 4):
        for ds in DATA_STAGES:
            if step == 4 and ds == "train":
                continue
            batch = BatchedDataDict({"x": torch.arange(8, dtype=torch.float32) + step, "s": [ds] * 8})
            storage.save_batch(batch, lay.stage_uri(step, ds), run_id=RUN, step=step, stage=ds)
    ck = lay.checkpoint_uri(2)
    os.makedirs(ck)
    with open(os.path.join(ck, "checkpoint.json"), "w") as fh:
        json.dump({"step": 2, "weights_version": 2}, fh)
    return lay


@pytest.fixture()
def layout(template, tmp_path) -> RunLayout:
    """A fresh copy of the synthetic run per test."""
    import shutil

    shutil.copytree(template.run_uri, os.path.join(tmp_path, RUN))
    return RunLayout(str(tmp_path), RUN)


def _shard(lay: RunLayout, step: int, ds: str) -> str:
    d = lay.stage_uri(step, ds)
    return os.path.join(d, next(f for f in sorted(os.listdir(d)) if f.endswith(".arrow")))


def test_window_is_after_the_anchor(layout):
    assert resume_window(layout) == (2, 3)


def test_plan_trained_step_recomputes_only_that_dataset(layout):
    assert plan_recompute(layout, [("generate", 3)]) == [(3, "rollouts")]
    assert plan_recompute(layout, [("score", 3), ("logprob", 3)]) == [(3, "rewards"), (3, "logprobs")]


def test_plan_untrained_step_recomputes_downstream(layout):
    assert plan_recompute(layout, [("generate", 4)]) == [(4, s) for s in ("rollouts", "rewards", "logprobs", "advantages", "train")]
    assert plan_recompute(layout, [("score", 4)]) == [(4, "rewards"), (4, "advantages"), (4, "train")]


@pytest.mark.parametrize(
    "spec, needle",
    [(("train", 3), "is trained"), (("generate", 2), "covered by the checkpoint"), (("score", 1), "covered by"),
     (("generate", 6), "not reached")],
)
def test_plan_refuses(layout, spec, needle):
    with pytest.raises(ValueError, match=needle):
        plan_recompute(layout, [spec])


def test_damaged_batches_named_with_the_repair(layout):
    with open(_shard(layout, 3, "rollouts"), "r+b") as fh:  # a flipped byte in a trained step's input
        fh.seek(200)
        b = fh.read(1)
        fh.seek(200)
        fh.write(bytes([b[0] ^ 0xFF]))
    os.remove(_shard(layout, 4, "rewards"))  # a missing shard in the step not trained yet
    with open(_shard(layout, 1, "rollouts"), "r+b") as fh:  # before the anchor: never read by a resume
        fh.write(b"garbage")
    damaged = find_damaged(layout)
    assert [(d.step, d.dataset, d.trained) for d in damaged] == [(3, "rollouts", True), (4, "rewards", False)]
    with pytest.raises(DamagedRunError) as ei:
        check_resume_data(layout)
    msg = str(ei.value)
    assert _shard(layout, 3, "rollouts") in msg and "CorruptDatasetError" in msg
    assert "MissingShardError" in msg and "rewards" in msg
    assert f"nrl resume {RUN} --storage {layout.root} --recompute generate@3 --recompute score@4" in msg
    # the planned deletions are not checked (the CLI passes them as skip), then they are gone
    plan = plan_recompute(layout, [("generate", 3), ("score", 4)])
    check_resume_data(layout, skip=plan)
    deleted = apply_recompute(layout, [("generate", 3), ("score", 4)])
    assert sorted(deleted) == sorted(
        layout.stage_uri(s, d) for s, d in [(3, "rollouts"), (4, "rewards"), (4, "advantages")]
    )
    check_resume_data(layout)
    import storage

    assert storage.is_committed(layout.stage_uri(3, "train")) and storage.is_committed(layout.stage_uri(3, "logprobs"))


def test_damaged_train_marker_cannot_be_recomputed(layout):
    with open(os.path.join(layout.stage_uri(3, "train"), "_manifest.json"), "w") as fh:
        fh.write("{not json")
    with pytest.raises(DamagedRunError, match="train marker is damaged"):
        check_resume_data(layout)
