"""TensorBoard as a tracker, read back with TensorBoard's own reader: every metrics-line figure a
curve, the resolved config as text, a resumed run appending to the same curves without a
duplicate or missing step, and a failing tracker never failing the run."""

from __future__ import annotations

import logging
import os

import pytest

from flows.trackers import TensorBoardTracker, TrackerSet, scalar_fields


def _scalars(path: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalar_fields_keep_finite_numbers_only():
    row = {"step": 3, "reward_mean": 0.5, "loss": None, "grad_norm": float("nan"), "logprob_skipped": True,
           "val_accuracy": 0.25, "reward_errors": "x", "rebuilt": True}
    assert scalar_fields(row) == {"train/reward_mean": 0.5, "train/logprob_skipped": 1.0, "validation/accuracy": 0.25}


def test_reopened_tracker_continues_without_duplicates(tmp_path):
    rows = [{"step": s, "reward_mean": s / 10} for s in range(1, 6)]
    t = TensorBoardTracker(str(tmp_path), "r", "a: 1")
    TrackerSet([t]).sync(rows[:3])
    t.close()
    again = TensorBoardTracker(str(tmp_path), "r", "a: 1")  # a resume: reads where the curves end
    assert again.last_step() == 3
    TrackerSet([again]).sync(rows)  # all lines again, as metrics.jsonl holds them
    again.close()
    got = _scalars(os.path.join(str(tmp_path), "r", "tensorboard"))["train/reward_mean"]
    assert [s for s, _ in got] == [1, 2, 3, 4, 5]
    assert [round(v, 6) for _, v in got] == [0.1, 0.2, 0.3, 0.4, 0.5]


def test_a_failing_tracker_is_warned_about_and_the_others_go_on(tmp_path, caplog):
    class Broken:
        def last_step(self) -> int:
            raise ConnectionError("tracking server down")

        def close(self) -> None: ...

    good = TensorBoardTracker(str(tmp_path), "r2")
    with caplog.at_level(logging.WARNING):
        TrackerSet([Broken(), good]).sync([{"step": 1, "reward_mean": 1.0}])
    assert "tracking server down" in caplog.text and good.last_step() == 1
    good.close()


def test_grpo_run_and_its_resume_write_one_curve_point_per_step(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flows.grpo import grpo
    from flows.metrics import read_metrics
    from tests.fixtures.grpo_runs import kill_run_actors, tiny_run_config

    root, logs, run_id = str(tmp_path / "runs"), str(tmp_path / "logs"), "tb-run"
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{
        "grpo.max_num_steps": 2, "logger.tensorboard_enabled": True, "logger.log_dir": logs})
    try:
        grpo(config=cfg, run_id=run_id)
        grpo(run_id=run_id, resume=True, storage=root, overrides=["grpo.max_num_steps=3"])
    finally:
        kill_run_actors(run_id)
    path = os.path.join(logs, run_id, "tensorboard")
    got = _scalars(path)
    rows = read_metrics(os.path.join(root, run_id, "metrics.jsonl"))
    for key in ("reward_mean", "loss", "train_s"):
        assert [s for s, _ in got[f"train/{key}"]] == [1, 2, 3], key
        assert [v for _, v in got[f"train/{key}"]] == pytest.approx([r[key] for r in rows], rel=1e-6), key
    acc = EventAccumulator(path)
    acc.Reload()
    assert "config" in " ".join(acc.Tags().get("tensors", [])), acc.Tags()
