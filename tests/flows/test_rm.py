"""``nrl rm`` (reward-model training, issue 43) through the real flow: the tiny model's folder loaded
with a new one-output head on Ray, real Prefect runs, Arrow on disk, the built-in arithmetic pairs
of ``configs/rm_tiny.yaml``; 6 steps of 8 pairs, validation and checkpoints at 3 and 6.

Checked: the Bradley-Terry loss falls and the chosen-vs-rejected margin rises; every step persists
its pairs and train metrics (no reference stage); the checkpoint's ``weights`` folder is a
``LlamaForSequenceClassification`` (GRPO scoring with it as ``env.reward_model.model_name``:
the pipeline test ``sft -> rm -> grpo``, tests/flows/test_pipeline.py); the flow SIGKILLed in the middle of step 5's update and resumed with
``nrl resume`` ends with the uninterrupted run's weights at every step (slow).
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import yaml

from tests.faults.helpers import run_nrl, train_checksum
from tests.fixtures.grpo_runs import REPO, kill_run_actors, tiny_run_config

RUN_ID = "rm-tiny"
STEPS = tuple(range(1, 7))


def _config(model_dir: str, root: str, ray_address: str | None) -> dict:
    return tiny_run_config(model_dir, root, ray_address, config=os.path.join(REPO, "configs", "rm_tiny.yaml"), **{
        "rm.max_num_steps": len(STEPS), "rm.val_period": 3, "checkpointing.save_period": 3})


@pytest.fixture(scope="module")
def rm_run(prefect_harness, ray_session, tiny_model_dir, tmp_path_factory):
    from flows.algorithms.rm import rm

    root = str(tmp_path_factory.mktemp("rm") / "runs")
    try:
        out = rm(config=_config(tiny_model_dir, root, ray_session), run_id=RUN_ID)
    finally:
        kill_run_actors(RUN_ID)
    return {"root": root, "out": out}


def test_the_reward_model_learns_the_pairs_and_every_step_is_persisted(rm_run):
    import storage
    from flows.observe.metrics import read_metrics

    root = rm_run["root"]
    rows = read_metrics(os.path.join(root, RUN_ID, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(STEPS)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean([r["loss"] for r in rows[-3:]]) < mean([r["loss"] for r in rows[:3]]), [r["loss"] for r in rows]
    assert mean([r["rewards_margin_mean"] for r in rows[-3:]]) > mean([r["rewards_margin_mean"] for r in rows[:3]])
    assert [r["step"] for r in rows if r.get("val_accuracy") is not None] == [3, 6]
    assert all(0.0 <= r["val_accuracy"] <= 1.0 and r["val_loss"] > 0 for r in rows if r.get("val_accuracy") is not None)
    for s in STEPS:
        d = os.path.join(root, RUN_ID, "steps", f"step_{s:06d}")
        assert sorted(os.listdir(d)) == ["pairs", "train"] + (["val"] if s % 3 == 0 else [])
        assert storage.read_manifest(os.path.join(d, "train")).meta["weights_checksum"]
    assert [os.path.basename(c) for c in rm_run["out"]["checkpoints"]] == ["step_000003", "step_000006"]
    with open(os.path.join(root, RUN_ID, "status.json"), encoding="utf-8") as fh:
        status = json.load(fh)
    assert status["status"] == "completed" and status["algorithm"] == "rm"
    with open(os.path.join(root, RUN_ID, "checkpoints", "step_000006", "weights", "config.json"), encoding="utf-8") as fh:
        hf = json.load(fh)
    assert hf["architectures"] == ["LlamaForSequenceClassification"] and hf.get("num_labels", 1) == 1


@pytest.mark.slow  # a killed whole-flow run and its resume
def test_killed_mid_update_then_resumed_is_bit_identical(rm_run, tmp_path, prefect_harness, ray_session, tiny_model_dir):
    root = str(tmp_path / "runs")
    cfg_path = tmp_path / "rm.yaml"
    cfg_path.write_text(yaml.safe_dump(_config(tiny_model_dir, root, ray_session)))
    run_id = "rm-kill"
    try:
        p = run_nrl(["rm", "--config", str(cfg_path), "--run-id", run_id], prefect_harness, kill_at="rm_train@5:during")
        assert p.returncode == -signal.SIGKILL, p.stdout[-2000:] + p.stderr[-3000:]
        kill_run_actors(run_id)
        p = run_nrl(["resume", run_id, "--storage", root], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        kill_run_actors(run_id)
    with open(os.path.join(root, run_id, "status.json"), encoding="utf-8") as fh:
        status = json.load(fh)
    assert status["status"] == "completed"
    assert status["restored"]["restored_from"] == os.path.join(root, run_id, "checkpoints", "step_000003")
    assert status["restored"]["replayed"] == [4]
    ref = rm_run["root"]
    assert [train_checksum(root, run_id, s) for s in STEPS] == [train_checksum(ref, RUN_ID, s) for s in STEPS]


def test_an_rm_config_without_the_reward_model_head_is_refused_naming_the_key():
    from flows.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="policy.reward_model_cfg.enabled=true"):
        load_config(os.path.join(REPO, "configs", "rm_tiny.yaml"), ["policy.reward_model_cfg.enabled=false"])
    with pytest.raises(ConfigError, match="only `nrl rm` trains a reward model"):
        load_config(os.path.join(REPO, "configs", "dpo_tiny.yaml"), ["policy.reward_model_cfg.enabled=true"])
    with pytest.raises(ConfigError, match="data-parallel reward-model training is not built"):
        load_config(os.path.join(REPO, "configs", "rm_tiny.yaml"), ["cluster.policy_workers=2"])


def test_nrl_eval_of_a_reward_model_run_says_why_not(rm_run, capsys):
    from flows.cli import main

    assert main(["eval", RUN_ID, "--storage", rm_run["root"]]) == 2
    err = capsys.readouterr().err
    assert "(rm) trains a reward model: its checkpoints answer no prompts" in err and "rm.val_period" in err
