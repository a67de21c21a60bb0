"""Retention policy logic (pure planning, property-checked) and its application to a real run
layout on local disk (real Arrow datasets, committed/uncommitted checkpoints)."""

from __future__ import annotations

import doctest
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flows.run import retention
from flows.run.retention import PRUNABLE_STAGES, RetentionPolicy, apply_retention, plan_retention
from nrl_tasks.run_layout import RunLayout


def test_doctests():
    assert doctest.testmod(retention).failed == 0


def test_no_settings_keep_everything():
    plan = plan_retention(RetentionPolicy(), last_trained=9, batch_steps=range(1, 10), checkpoint_steps=[3, 6, 9])
    assert plan.delete_steps == [] and plan.delete_checkpoints == []
    assert plan.anchor == 9


def test_batches_after_the_anchor_are_kept_for_replay():
    # newest checkpoint at 4, run trained to 9: steps 5..9 must stay even with K=1
    plan = plan_retention(
        RetentionPolicy(keep_last_k_steps=1), last_trained=9, batch_steps=range(1, 10), checkpoint_steps=[2, 4]
    )
    assert plan.anchor == 4
    assert plan.delete_steps == [1, 2, 3, 4]
    assert plan.keep_steps == [5, 6, 7, 8, 9]


def test_without_a_checkpoint_no_batch_goes():
    plan = plan_retention(RetentionPolicy(keep_last_k_steps=1), last_trained=5, batch_steps=range(1, 6), checkpoint_steps=[])
    assert plan.anchor is None and plan.delete_steps == []


def test_untrained_steps_and_future_checkpoints_are_left_alone():
    plan = plan_retention(
        RetentionPolicy(keep_last_k_steps=1, keep_last_n_checkpoints=1),
        last_trained=4, batch_steps=[1, 2, 3, 4, 5, 6], checkpoint_steps=[2, 4, 6],
    )
    assert plan.anchor == 4
    assert plan.delete_steps == [1, 2, 3]
    assert plan.delete_checkpoints == [2] and plan.keep_checkpoints == [4, 6]


def test_top_k_by_metric_ignores_missing_and_nan_and_breaks_ties_by_recency():
    scores = {2: 0.5, 4: float("nan"), 6: 0.5, 8: 0.1}
    plan = plan_retention(
        RetentionPolicy(keep_top_k_checkpoints=1), last_trained=10, batch_steps=[],
        checkpoint_steps=[2, 4, 6, 8, 10], scores=scores,
    )
    assert plan.keep_checkpoints == [6, 10]  # best (tie 2/6 -> newer) + anchor
    low = plan_retention(
        RetentionPolicy(keep_top_k_checkpoints=2, higher_is_better=False), last_trained=10, batch_steps=[],
        checkpoint_steps=[2, 4, 6, 8, 10], scores=scores,
    )
    assert low.keep_checkpoints == [6, 8, 10]


@pytest.mark.parametrize("field", ["keep_last_k_steps", "keep_last_n_checkpoints", "keep_top_k_checkpoints"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_settings_name_the_field(field, bad):
    with pytest.raises(ValueError, match=field):
        RetentionPolicy(**{field: bad})


def test_negative_last_trained_is_rejected():
    with pytest.raises(ValueError, match="last_trained"):
        plan_retention(RetentionPolicy(), last_trained=-1, batch_steps=[], checkpoint_steps=[])


@settings(max_examples=60, deadline=None)
@given(
    last=st.integers(0, 30),
    extra=st.integers(0, 3),
    ck=st.sets(st.integers(1, 33), max_size=8),
    k=st.one_of(st.none(), st.integers(1, 6)),
    n=st.one_of(st.none(), st.integers(1, 4)),
    t=st.one_of(st.none(), st.integers(1, 3)),
    score_seed=st.integers(0, 1000),
)
def test_plan_never_deletes_what_resume_needs(last, extra, ck, k, n, t, score_seed):
    gen = torch.Generator().manual_seed(score_seed)
    scores = {s: float(torch.rand((), generator=gen)) for s in ck if s % 2 == 0}
    steps = list(range(1, last + extra + 1))
    pol = RetentionPolicy(keep_last_k_steps=k, keep_last_n_checkpoints=n, keep_top_k_checkpoints=t)
    plan = plan_retention(pol, last_trained=last, batch_steps=steps, checkpoint_steps=ck, scores=scores)
    eligible = sorted(s for s in ck if s <= last)
    anchor = eligible[-1] if eligible else None
    assert plan.anchor == anchor
    # resume restores the anchor and replays every step after it from its batches
    if anchor is not None:
        assert anchor in plan.keep_checkpoints
    assert all(s <= (anchor or 0) for s in plan.delete_steps)
    if k is not None:
        assert all(s <= last - k for s in plan.delete_steps)
        # everything the policy allows does go
        if anchor is not None:
            assert plan.delete_steps == [s for s in steps if s <= min(anchor, last - k)]
    else:
        assert plan.delete_steps == []
    assert sorted(plan.delete_steps + plan.keep_steps) == steps
    assert sorted(plan.delete_checkpoints + plan.keep_checkpoints) == sorted(ck)
    assert all(s <= last for s in plan.delete_checkpoints)
    if n is None and t is None:
        assert plan.delete_checkpoints == []
    else:
        bound = (n or 0) + (t or 0) + 1
        assert len([s for s in plan.keep_checkpoints if s <= last]) <= bound
        if n is not None:
            assert set(eligible[-n:]) <= set(plan.keep_checkpoints)


# ----------------------------------------------------------------------------------------------
# applied to a run layout on disk


def _fake_run(root: str, run_id: str, steps: int, ck_steps: list[int], val: dict[int, float]) -> RunLayout:
    import storage

    from flows.observe.metrics import upsert_metrics

    lay = RunLayout(root, run_id)
    for s in range(1, steps + 1):
        for stage in PRUNABLE_STAGES:
            storage.save_batch({"x": torch.full((4, 16), float(s))}, lay.stage_uri(s, stage), step=s, stage=stage)
        storage.save_batch({"loss": torch.tensor([0.1 * s])}, lay.stage_uri(s, "train"), step=s, stage="train")
        row = {"step": s, "reward_mean": 0.0}
        if s in val:
            storage.save_batch({"acc": torch.tensor([val[s]])}, lay.stage_uri(s, "val"), step=s, stage="val")
            row["val_accuracy"] = val[s]
        upsert_metrics(lay.metrics_uri, row)
    for s in ck_steps:
        d = os.path.join(lay.checkpoint_uri(s), "weights")
        os.makedirs(d)
        with open(os.path.join(d, "model.safetensors"), "wb") as fh:
            fh.write(b"\0" * 1024)
        with open(os.path.join(lay.checkpoint_uri(s), "checkpoint.json"), "w") as fh:
            json.dump({"step": s, "weights_version": s}, fh)
    return lay


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_apply_retention_on_disk(tmp_path):
    import storage

    from flows.run.state import trained_prefix
    from nrl_tasks.stages.checkpoint import latest_checkpoint, list_checkpoints

    root = str(tmp_path)
    lay = _fake_run(root, "r1", steps=7, ck_steps=[2, 4, 6], val={2: 0.9, 4: 0.1, 6: 0.3})
    before = _du(lay.run_uri)
    pol = RetentionPolicy(keep_last_k_steps=2, keep_last_n_checkpoints=1, keep_top_k_checkpoints=1)
    seen: set[int] = set()
    out = apply_retention(lay, pol, last_trained=7, pruned=seen)
    assert out["anchor"] == 6
    assert out["deleted_checkpoints"] == [4]
    assert [s for s, _ in list_checkpoints(lay.checkpoints_uri)] == [2, 6]
    assert not os.path.exists(lay.checkpoint_uri(4))
    assert out["deleted_steps"] == [1, 2, 3, 4, 5]
    for s in range(1, 8):
        kept = s >= 6
        for stage in PRUNABLE_STAGES:
            assert storage.is_committed(lay.stage_uri(s, stage)) is kept, (s, stage)
            assert os.path.exists(lay.stage_uri(s, stage)) is kept
        assert storage.is_committed(lay.stage_uri(s, "train"))  # marks the step trained
    assert storage.is_committed(lay.stage_uri(2, "val"))
    # what resume reads is intact
    assert trained_prefix(lay) == 7
    assert latest_checkpoint(lay.checkpoints_uri, max_step=7)[0] == 6
    for stage in PRUNABLE_STAGES:
        storage.load_batch(lay.stage_uri(7, stage))
    assert _du(lay.run_uri) < before
    # idempotent, and a fresh process (no record of what it pruned) finds nothing more to do
    assert seen == {1, 2, 3, 4, 5}
    assert apply_retention(lay, pol, last_trained=7, pruned=seen)["deleted_steps"] == []
    again = apply_retention(lay, pol, last_trained=7)
    assert again["deleted_steps"] == [] and again["deleted_checkpoints"] == []


def test_apply_retention_inactive_touches_nothing(tmp_path):
    lay = _fake_run(str(tmp_path), "r2", steps=3, ck_steps=[2], val={})
    before = _du(lay.run_uri)
    out = apply_retention(lay, RetentionPolicy(), last_trained=3)
    assert out["deleted_steps"] == [] and _du(lay.run_uri) == before


def test_half_deleted_checkpoint_is_not_committed_and_deletion_finishes(tmp_path):
    from nrl_tasks.stages.checkpoint import list_checkpoints

    lay = _fake_run(str(tmp_path), "r3", steps=4, ck_steps=[2, 4], val={})
    # a retention killed after uncommitting checkpoint 2: readers must not see it
    os.remove(os.path.join(lay.checkpoint_uri(2), "checkpoint.json"))
    assert [s for s, _ in list_checkpoints(lay.checkpoints_uri)] == [4]
    retention.delete_checkpoint(lay.checkpoint_uri(2))
    retention.delete_checkpoint(lay.checkpoint_uri(2))  # idempotent
    assert not os.path.exists(lay.checkpoint_uri(2))


# ----------------------------------------------------------------------------------------------
# checkpoints held by a reader (an evaluation)


def test_held_checkpoint_is_kept_and_goes_on_the_pass_after_release(tmp_path):
    from nrl_tasks.stages.checkpoint import list_checkpoints
    from nrl_tasks.stages.holds import claim_checkpoint, hold_checkpoint, list_holds

    lay = _fake_run(str(tmp_path), "r4", steps=6, ck_steps=[2, 4, 6], val={})
    pol = RetentionPolicy(keep_last_n_checkpoints=1)
    hold = hold_checkpoint(lay, "step_000002")
    claim = claim_checkpoint(lay, "step_000004", "val")
    assert claim is not None and claim_checkpoint(lay, "step_000004", "val") is None  # exclusive
    out = apply_retention(lay, pol, last_trained=6)
    assert out["deleted_checkpoints"] == [] and out["held_checkpoints"] == [2, 4]
    assert [s for s, _ in list_checkpoints(lay.checkpoints_uri)] == [2, 4, 6]
    hold.release()
    out = apply_retention(lay, pol, last_trained=6)
    assert out["deleted_checkpoints"] == [2] and out["held_checkpoints"] == [4]
    claim.release()
    out = apply_retention(lay, pol, last_trained=6)
    assert out["deleted_checkpoints"] == [4] and out["held_checkpoints"] == []
    assert [s for s, _ in list_checkpoints(lay.checkpoints_uri)] == [6]
    assert list_holds(lay) == []


def test_dead_holders_are_ignored_and_cleaned(tmp_path):
    import socket
    import subprocess
    import sys
    import time

    from nrl_tasks.stages.holds import holds_uri

    lay = _fake_run(str(tmp_path), "r5", steps=4, ck_steps=[2, 4], val={})
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    base = holds_uri(lay).replace("file://", "")
    os.makedirs(base)
    far = time.time() + 3600
    records = {
        "step_000002.hold.pidgone.json": {"pid": dead_pid, "host": socket.gethostname(), "expires_unix": far},
        "step_000002.hold.expired.json": {"pid": os.getpid(), "host": "elsewhere", "expires_unix": time.time() - 1},
        "step_000002.claim.val.json": {"pid": dead_pid, "host": socket.gethostname(), "expires_unix": far},
    }
    for name, rec in records.items():
        with open(os.path.join(base, name), "w") as fh:
            json.dump({"checkpoint": "step_000002", "kind": name.split(".")[1], "holder": name, **rec}, fh)
    out = apply_retention(lay, RetentionPolicy(keep_last_n_checkpoints=1), last_trained=4)
    assert out["deleted_checkpoints"] == [2]
    assert os.listdir(base) == []


def test_a_hold_taken_while_retention_decides_keeps_the_checkpoint(tmp_path, monkeypatch):
    """The race retention-decides vs reader-takes-hold: the reader's hold lands after the plan
    (and after retention's first look); retention looks again after its deletion mark and keeps it."""
    from nrl_tasks.stages import holds
    from nrl_tasks.stages.checkpoint import list_checkpoints

    lay = _fake_run(str(tmp_path), "r6", steps=4, ck_steps=[2, 4], val={})
    taken = []
    real_mark = holds.mark_deleting

    def mark_then_reader_arrives(layout, checkpoint, storage_options=None, **kw):
        mark = real_mark(layout, checkpoint, storage_options, **kw)
        taken.append(holds.hold_checkpoint(layout, checkpoint))
        # the reader, having written its hold, sees the mark: it must skip the checkpoint
        assert holds.is_deleting(layout, checkpoint)
        return mark

    monkeypatch.setattr(retention, "mark_deleting", mark_then_reader_arrives)  # as retention calls it
    out = apply_retention(lay, RetentionPolicy(keep_last_n_checkpoints=1), last_trained=4)
    assert out["deleted_checkpoints"] == [] and out["held_checkpoints"] == [2]
    assert [s for s, _ in list_checkpoints(lay.checkpoints_uri)] == [2, 4]
    assert not holds.is_deleting(lay, "step_000002")  # the mark is withdrawn
    taken[0].release()
    monkeypatch.setattr(retention, "mark_deleting", real_mark)
    assert apply_retention(lay, RetentionPolicy(keep_last_n_checkpoints=1), last_trained=4)["deleted_checkpoints"] == [2]


def test_holds_and_retention_on_s3(moto_s3):
    from storage import fs

    from nrl_tasks.stages.checkpoint import list_checkpoints
    from nrl_tasks.stages.holds import claim_checkpoint, hold_checkpoint, list_holds

    opts = moto_s3.storage_options
    lay = RunLayout(moto_s3.make_bucket(), "r7")
    for s in (2, 4):
        fs.write_bytes_atomic(f"{lay.checkpoint_uri(s)}/weights/model.safetensors", b"\0" * 64, opts)
        fs.write_text_atomic(f"{lay.checkpoint_uri(s)}/checkpoint.json", json.dumps({"step": s}), opts)
    claim = claim_checkpoint(lay, "step_000002", "val", opts)
    assert claim is not None and claim_checkpoint(lay, "step_000002", "val", opts) is None  # create-only on S3
    pol = RetentionPolicy(keep_last_n_checkpoints=1)
    out = apply_retention(lay, pol, last_trained=4, storage_options=opts)
    assert out["held_checkpoints"] == [2] and [s for s, _ in list_checkpoints(lay.checkpoints_uri, opts)] == [2, 4]
    claim.release()
    with hold_checkpoint(lay, "step_000002", opts):
        assert apply_retention(lay, pol, last_trained=4, storage_options=opts)["held_checkpoints"] == [2]
    assert apply_retention(lay, pol, last_trained=4, storage_options=opts)["deleted_checkpoints"] == [2]
    assert [s for s, _ in list_checkpoints(lay.checkpoints_uri, opts)] == [4]
    assert list_holds(lay, storage_options=opts) == []


def test_dynamic_sampling_generation_batches_go_with_their_step(tmp_path):
    import storage

    from flows.run.retention import delete_step_batches
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

    lay = _fake_run(str(tmp_path), "r-ds", steps=2, ck_steps=[], val={})
    for j in range(2):
        for stage in ("prompts", "rollouts", "rewards"):
            storage.save_batch(BatchedDataDict({"x": torch.zeros(2)}), lay.gen_batch_uri(1, j, stage))
    deleted = delete_step_batches(lay, 1)
    assert lay.gen_batches_uri(1) in deleted
    assert not os.path.exists(lay.gen_batches_uri(1))
    assert storage.is_committed(lay.stage_uri(1, "train"))
