"""Evaluation next to retention and next to another evaluation (issue 14), on real files with
the tiny model: retention keeps the checkpoint an evaluation holds, a checkpoint that vanishes
mid-sweep is skipped, two concurrent sweeps on one run split the checkpoints and both succeed."""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
import yaml

from tests.flows.conftest import tiny_run_config

RUN_ID = "eval-holds"
CHECKPOINTS = ("step_000002", "step_000004")


@pytest.fixture
def eval_run(tmp_path, tiny_model_dir, ray_session, prefect_harness):
    """A run with two committed checkpoints (the tiny model's weights) and its saved config."""
    from nrl_tasks.run_layout import RunLayout

    root = str(tmp_path / "runs")
    layout = RunLayout(root, RUN_ID)
    os.makedirs(layout.run_uri)
    with open(layout.config_uri, "w", encoding="utf-8") as fh:
        yaml.safe_dump(tiny_run_config(tiny_model_dir, root, ray_session), fh)
    for name in CHECKPOINTS:
        ck = os.path.join(layout.checkpoints_uri, name)
        shutil.copytree(tiny_model_dir, os.path.join(ck, "weights"))
        step = int(name.split("_")[1])
        with open(os.path.join(ck, "checkpoint.json"), "w", encoding="utf-8") as fh:
            json.dump({"run_id": RUN_ID, "step": step, "weights_version": step}, fh)
    return {"root": root, "layout": layout}


def _committed_evals(layout) -> list[str]:
    import storage

    return sorted(ck for ck in CHECKPOINTS if storage.is_committed(os.path.join(layout.eval_uri(ck), "val")))


def test_checkpoint_deleted_mid_sweep_is_skipped(eval_run, monkeypatch):
    from flows.algorithms.evaluate import eval_sweep
    from nrl_tasks.stages import checkpoint
    from nrl_tasks.stages import evaluate as stage_evaluate

    real = checkpoint.local_checkpoint_dir

    def deleted_while_loading(uri, storage_options=None):
        if uri.rstrip("/").endswith("step_000002"):
            shutil.rmtree(uri)  # gone under the evaluation (by hand, or a deleter that ignores holds)
        return real(uri, storage_options)

    monkeypatch.setattr(stage_evaluate, "local_checkpoint_dir", deleted_while_loading)  # as the evaluation calls it
    res = eval_sweep(RUN_ID, storage=eval_run["root"], num_samples=1, max_prompts=2)
    assert res["vanished"] == [f"{RUN_ID}/step_000002"]
    assert res["evaluated"] == [f"{RUN_ID}/step_000004"]
    assert [r["checkpoint"] for r in res["rows"]] == ["step_000004"]
    assert _committed_evals(eval_run["layout"]) == ["step_000004"]
    assert os.listdir(os.path.join(eval_run["layout"].run_uri, "holds")) == []  # claims released


def test_retention_during_an_evaluation_keeps_its_checkpoint(eval_run, monkeypatch):
    from flows.algorithms.evaluate import eval_sweep
    from flows.run.retention import RetentionPolicy, apply_retention
    from nrl_tasks.stages import checkpoint
    from nrl_tasks.stages import evaluate as stage_evaluate

    layout, pol = eval_run["layout"], RetentionPolicy(keep_last_n_checkpoints=1)
    real, during = checkpoint.local_checkpoint_dir, []

    def retention_runs_meanwhile(uri, storage_options=None):
        if uri.rstrip("/").endswith("step_000002"):
            during.append(apply_retention(layout, pol, last_trained=4))  # the training flow, after a step
        return real(uri, storage_options)

    monkeypatch.setattr(stage_evaluate, "local_checkpoint_dir", retention_runs_meanwhile)
    res = eval_sweep(RUN_ID, storage=eval_run["root"], num_samples=1, max_prompts=2)
    assert during[0]["held_checkpoints"] == [2] and during[0]["deleted_checkpoints"] == []
    assert sorted(res["evaluated"]) == [f"{RUN_ID}/{ck}" for ck in CHECKPOINTS] and res["vanished"] == []
    after = apply_retention(layout, pol, last_trained=4)  # the next pass, the claim released
    assert after["deleted_checkpoints"] == [2] and not os.path.exists(os.path.join(layout.checkpoints_uri, "step_000002"))


def test_two_concurrent_sweeps_evaluate_each_checkpoint_once(eval_run):
    from flows.algorithms.evaluate import _eval_rows, eval_sweep

    start = threading.Barrier(2)
    results, errors = [], []

    def sweep():
        start.wait()
        try:
            results.append(eval_sweep(RUN_ID, storage=eval_run["root"], num_samples=1, max_prompts=2))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=sweep) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    assert not errors, errors
    assert len(results) == 2
    evaluated = sorted(c for r in results for c in r["evaluated"])
    assert evaluated == [f"{RUN_ID}/{ck}" for ck in CHECKPOINTS]  # each exactly once, none lost
    for r in results:  # the other sweep's checkpoints: already done, or being done by it
        assert sorted(r["evaluated"] + r["skipped"] + r["busy"]) == [f"{RUN_ID}/{ck}" for ck in CHECKPOINTS]
        assert r["vanished"] == []
    rows = _eval_rows(eval_run["root"], RUN_ID, None)
    assert sorted(row["checkpoint"] for row in rows) == list(CHECKPOINTS)


def _commit_checkpoint(layout, tiny_model_dir: str, step: int) -> None:
    """What the training flow's checkpoint stage leaves: weights, then ``checkpoint.json``."""
    ck = os.path.join(layout.checkpoints_uri, f"step_{step:06d}")
    shutil.copytree(tiny_model_dir, os.path.join(ck, "weights"))
    with open(os.path.join(ck, "checkpoint.json"), "w", encoding="utf-8") as fh:
        json.dump({"run_id": RUN_ID, "step": step, "weights_version": step}, fh)


def test_tight_retention_between_listing_and_evaluation_keeps_the_listed_checkpoints(eval_run, monkeypatch):
    """Issue 27 (10b): with ``keep_last_k=1`` and ``save_period=1`` the training flow deletes a
    checkpoint one step after writing it. The sweep holds what it lists at once, so retention
    running before the evaluation starts (while the sweep loads prompts and starts Ray) keeps it."""
    from flows.algorithms import evaluate as ev
    from flows.run.retention import RetentionPolicy, apply_retention

    layout, pol = eval_run["layout"], RetentionPolicy(keep_last_n_checkpoints=1)
    real, during = ev._records, []

    def training_goes_on(*args, **kwargs):
        during.append(apply_retention(layout, pol, last_trained=4))
        return real(*args, **kwargs)

    monkeypatch.setattr(ev, "_records", training_goes_on)
    res = ev.eval_sweep(RUN_ID, storage=eval_run["root"], num_samples=1, max_prompts=2)
    assert during[0]["held_checkpoints"] == [2] and during[0]["deleted_checkpoints"] == []
    assert res["evaluated"] == [f"{RUN_ID}/{ck}" for ck in CHECKPOINTS] and res["vanished"] == []
    assert _committed_evals(layout) == list(CHECKPOINTS)
    assert os.listdir(os.path.join(layout.run_uri, "holds")) == []  # every hold released
    assert apply_retention(layout, pol, last_trained=4)["deleted_checkpoints"] == [2]


def test_checkpoints_deleted_before_their_hold_make_the_sweep_list_again(eval_run, tiny_model_dir, monkeypatch):
    """A checkpoint that goes between the listing and its hold is reported vanished, and the sweep
    lists the run again: the newer checkpoint written meanwhile is held and evaluated."""
    from flows.algorithms import evaluate as ev
    from flows.run.retention import RetentionPolicy, apply_retention
    from nrl_tasks.stages import holds

    layout, pol = eval_run["layout"], RetentionPolicy(keep_last_n_checkpoints=1)
    real = holds.hold_checkpoint

    def a_step_trains_first(lay, name, *args, **kwargs):
        if name == "step_000002" and not os.path.exists(os.path.join(layout.checkpoints_uri, "step_000006")):
            _commit_checkpoint(layout, tiny_model_dir, 6)
            apply_retention(layout, pol, last_trained=6)  # deletes steps 2 and 4, held by nobody yet
        return real(lay, name, *args, **kwargs)

    monkeypatch.setattr(ev, "hold_checkpoint", a_step_trains_first)  # as the sweep calls it
    res = ev.eval_sweep(RUN_ID, storage=eval_run["root"], num_samples=1, max_prompts=2)
    assert res["vanished"] == [f"{RUN_ID}/step_000002", f"{RUN_ID}/step_000004"]
    assert res["evaluated"] == [f"{RUN_ID}/step_000006"]
    assert storage_committed(layout, "step_000006")
    assert os.listdir(os.path.join(layout.run_uri, "holds")) == []


def storage_committed(layout, checkpoint: str) -> bool:
    import storage

    return storage.is_committed(os.path.join(layout.eval_uri(checkpoint), "val"))
