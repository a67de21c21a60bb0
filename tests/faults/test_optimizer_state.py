"""A resume that would train on from a checkpoint holding no optimizer state
(``checkpointing.save_optimizer: false``) is refused before anything starts (exit 2, naming the
key and ``--fresh-optimizer``); with ``--fresh-optimizer`` it trains and records it in
``status.json`` and in the metrics line of the first step trained (issue 27, item 1; slow: two
whole flow runs).
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.faults.helpers import run_nrl
from tests.fixtures.grpo_runs import kill_run_actors, tiny_run_config

pytestmark = pytest.mark.slow


def _status(root: str, run_id: str) -> dict:
    with open(os.path.join(root, run_id, "status.json"), encoding="utf-8") as fh:
        return json.load(fh)


def _metrics(root: str, run_id: str) -> dict[int, dict]:
    with open(os.path.join(root, run_id, "metrics.jsonl"), encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return {int(r["step"]): r for r in rows}


def test_extending_a_run_saved_without_optimizer_state_is_refused_unless_fresh_optimizer(
    prefect_harness, ray_session, tiny_model_dir, tmp_path
):
    root, run_id = str(tmp_path / "runs"), "no-opt"
    cfg_path = tmp_path / "cfg.yaml"
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{"grpo.max_num_steps": 2, "checkpointing.save_optimizer": False})
    cfg_path.write_text(yaml.safe_dump(cfg))
    try:
        p = run_nrl(["grpo", "--config", str(cfg_path), "--run-id", run_id], prefect_harness)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        with open(os.path.join(root, run_id, "checkpoints", "step_000002", "checkpoint.json"), encoding="utf-8") as fh:
            assert json.load(fh)["optimizer"] is False

        p = run_nrl(["resume", run_id, "--storage", root, "grpo.max_num_steps=3"], prefect_harness)
        err = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
        assert p.returncode == 2, (p.stdout + p.stderr)[-3000:]
        assert "checkpointing.save_optimizer" in err and f"nrl resume {run_id} --fresh-optimizer" in err, err
        assert _status(root, run_id)["status"] == "completed"  # nothing started
        assert not os.path.exists(os.path.join(root, run_id, "steps", "step_000003")), "refused, yet step 3 was written"

        p = run_nrl(["resume", run_id, "--storage", root, "grpo.max_num_steps=3", "--fresh-optimizer"], prefect_harness)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        status = _status(root, run_id)
        assert status["status"] == "completed", status
        assert status["optimizer_reset"]["checkpoint_step"] == 2 and status["optimizer_reset"]["first_step"] == 3, status
        lines = _metrics(root, run_id)
        assert lines[3].get("optimizer_reset") is True, lines[3]
        assert "optimizer_reset" not in lines[2], lines[2]
    finally:
        kill_run_actors(run_id)


def test_an_actor_fault_that_would_restore_a_checkpoint_without_optimizer_state_stops_the_run(
    prefect_harness, ray_session, tiny_model_dir, tmp_path
):
    """Inside a run too: the policy killed in ``train`` of step 3 makes the recovery restore
    checkpoint 2, saved without optimizer state; the run stops (exit 1) naming
    ``checkpointing.save_optimizer`` and ``--fresh-optimizer`` instead of training step 3 with a fresh
    optimizer unannounced; ``nrl resume --fresh-optimizer`` then finishes it, recorded."""
    root, run_id = str(tmp_path / "runs"), "no-opt-fault"
    cfg_path = tmp_path / "cfg.yaml"
    cfg = tiny_run_config(tiny_model_dir, root, ray_session, **{"checkpointing.save_optimizer": False})
    cfg_path.write_text(yaml.safe_dump(cfg))
    try:
        p = run_nrl(["grpo", "--config", str(cfg_path), "--run-id", run_id], prefect_harness,
                    env_extra={"NRL_FAULT_KILL_ACTOR_AT": "policy:train@3", "NRL_PROBE_TIMEOUT_S": "3"})
        out = p.stdout + p.stderr
        assert p.returncode == 1, out[-3000:]
        assert "checkpointing.save_optimizer" in out and f"nrl resume {run_id} --fresh-optimizer" in out, out[-3000:]
        status = _status(root, run_id)
        assert status["status"] == "failed" and "checkpointing.save_optimizer" in status["error"], status
        assert not os.path.exists(os.path.join(root, run_id, "steps", "step_000003", "train", "_manifest.json"))

        p = run_nrl(["resume", run_id, "--storage", root, "--fresh-optimizer"], prefect_harness)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        assert _status(root, run_id)["optimizer_reset"]["checkpoint_step"] == 2
        assert _metrics(root, run_id)[3].get("optimizer_reset") is True
    finally:
        kill_run_actors(run_id)
