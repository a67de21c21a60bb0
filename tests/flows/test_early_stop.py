"""NeMo-RL's ``grpo.stop_at_validation_metric`` / ``stop_at_validation_threshold`` (issue 42): the
run ends after the first validation whose figure reaches the threshold, that step saves a
checkpoint, the run is recorded completed at that step, and a resume finds it finished (it stops
at the same committed validation again). Refused where it cannot be honoured: without a threshold,
without validations, in a pipeline stage."""

from __future__ import annotations

import json
import os

import pytest

from flows.config import ConfigError, load_config
from flows.run.recipe import StopRule
from tests.fixtures.grpo_runs import REPO, kill_run_actors, tiny_run_config

TINY = os.path.join(REPO, "configs", "grpo_tiny.yaml")


@pytest.mark.slow  # a run and its resume (keeps make test under 10 minutes)
def test_grpo_ends_after_the_first_validation_reaching_the_threshold_and_stays_ended(
        prefect_harness, ray_session, tiny_model_dir, tmp_path):
    from flows.algorithms.grpo import GRPO, grpo
    from flows.observe.metrics import read_metrics

    root = str(tmp_path / "runs")
    # accuracy >= 0 holds at the first validation (step 2): steps 3-5 of the subflow's segment never run
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{
        "grpo.max_num_steps": 5, "grpo.val_period": 2, "checkpointing.save_period": 10,
        "grpo.stop_at_validation_metric": "accuracy", "grpo.stop_at_validation_threshold": 0.0})
    assert GRPO.stop_rule(load_config(cfg)) == StopRule("val_accuracy", 0.0, "grpo.stop_at_validation_metric")
    try:
        out = grpo(config=cfg, run_id="early")
        rows = read_metrics(os.path.join(root, "early", "metrics.jsonl"))
        assert [r["step"] for r in rows] == [1, 2] and rows[-1]["val_accuracy"] is not None
        assert out["last_step"] == 2 and out["stopped_early"]["step"] == 2
        assert "val_accuracy" in out["stopped_early"]["why"]
        checkpoints = sorted(os.listdir(os.path.join(root, "early", "checkpoints")))
        assert checkpoints == ["step_000002"]  # the stop's step saves one (save_period is 10)
        with open(os.path.join(root, "early", "status.json"), encoding="utf-8") as fh:
            status = json.load(fh)
        assert status["status"] == "completed" and status["last_step"] == 2 and status["stopped_early"]["step"] == 2
        assert not os.path.exists(os.path.join(root, "early", "steps", "step_000003"))

        again = grpo(run_id="early", resume=True, storage=root)  # finished: the same validation stops it again
        assert again["last_step"] == 2
        assert [r["step"] for r in read_metrics(os.path.join(root, "early", "metrics.jsonl"))] == [1, 2]
        assert not os.path.exists(os.path.join(root, "early", "steps", "step_000003"))
    finally:
        kill_run_actors("early")


@pytest.mark.parametrize("extra, needle", [
    (["grpo.stop_at_validation_metric=accuracy"], "grpo.stop_at_validation_threshold must be set"),
    (["grpo.stop_at_validation_metric=accuracy", "grpo.stop_at_validation_threshold=0.5", "grpo.val_period=0"],
     "needs validations to read"),
    (["grpo.stop_at_validation_metric=pass_k", "grpo.stop_at_validation_threshold=0.5"], "stop_at_validation_metric"),
])
def test_an_early_stop_that_cannot_be_honoured_is_refused_by_name(extra, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(TINY, ["grpo.val_period=2", *extra])


def test_a_pipeline_stage_with_an_early_stop_is_refused_before_anything_starts(tmp_path):
    from flows.config import read_config_data
    from flows.pipeline import plan_stages

    spec = {"stages": [{"name": "grpo", "config": TINY, "config_data": read_config_data(TINY, [
        "grpo.val_period=2", "grpo.stop_at_validation_metric=accuracy", "grpo.stop_at_validation_threshold=0.5",
    ])}]}
    with pytest.raises(ConfigError, match="grpo.stop_at_validation_metric: a pipeline stage runs its whole budget"):
        plan_stages(spec, str(tmp_path / "runs"), "p")
    assert not os.path.exists(tmp_path / "runs" / "p-grpo")
