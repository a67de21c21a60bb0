"""Extending a finished run the way a deployment does: it always sends its default ``config``
parameter. With ``resume=true`` that config is ignored (warning) when it matches the run's saved
settings and refused, naming the keys, when it would change them; the deployment form shows
what each parameter means."""

from __future__ import annotations

import os

import pytest
import yaml

from tests.fixtures.grpo_runs import kill_run_actors, tiny_run_config


def test_grpo_parameters_have_descriptions_for_the_deployment_form():
    from prefect.utilities.callables import parameter_schema

    from flows.algorithms.grpo import grpo

    props = parameter_schema(grpo.fn).model_dump()["properties"]
    for name in ("config", "run_id", "resume", "overrides", "storage", "recompute", "take_over"):
        assert props[name].get("description"), name
    assert "grpo.max_num_steps=70" in props["resume"]["description"]


@pytest.mark.slow  # a whole flow run (+ resume): keeps make test under 15 minutes
def test_extend_a_finished_run_with_the_deployment_default_config(tmp_path, prefect_harness, ray_session, tiny_model_dir):
    from flows.config import ConfigError
    from flows.algorithms.grpo import grpo
    from flows.observe.metrics import read_metrics

    root = str(tmp_path / "runs")
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{"grpo.max_num_steps": 2, "checkpointing.save_period": 1})
    path = tmp_path / "grpo.yaml"  # what the deployment's `config` parameter points at
    path.write_text(yaml.safe_dump(cfg))
    run_id = "extend-me"
    try:
        grpo(config=str(path), run_id=run_id)
        other = tmp_path / "other.yaml"  # a config that would change the run
        cfg["policy"]["optimizer"]["kwargs"]["lr"] = 0.5
        other.write_text(yaml.safe_dump(cfg))
        with pytest.raises(ConfigError, match=r"changes the run's saved config in policy.optimizer.kwargs.lr"):
            grpo(config=str(other), run_id=run_id, resume=True, storage=root)
        with pytest.raises(ConfigError, match=r"config hash mismatch .*\(changed: grpo.seed\)"):  # an override that changes the run
            grpo(run_id=run_id, resume=True, storage=root, overrides=["grpo.seed=7"])
        out = grpo(config=str(path), run_id=run_id, resume=True, storage=root, overrides=["grpo.max_num_steps=3"])
    finally:
        kill_run_actors(run_id)
    assert out["last_step"] == 3
    assert [r["step"] for r in read_metrics(os.path.join(root, run_id, "metrics.jsonl"))] == [1, 2, 3]
