"""The post-training pipeline as one resumable Prefect flow (issue 40, item 5), on the tiny model.

- every stage's config is checked before anything starts: one error naming each stage's problem,
  exit 2, nothing written;
- ``configs/pipeline_tiny.yaml`` (sft -> dpo -> grpo -> eval) runs its stage runs as
  ``S/P-sft``, ``S/P-dpo``, ``S/P-grpo``, each from the previous stage's final checkpoint; the
  Prefect API shows one pipeline flow run with one subflow per stage (slow);
- SIGKILLed in the DPO stage and resumed with ``nrl resume P``: the SFT stage is not run again
  and the final GRPO checkpoint is bit-identical to the uninterrupted pipeline's (slow);
- a gate that is not met stops the pipeline before the next stage (exit 3, the flow run in a
  state named ``Gated`` with the message, the summary saying which gate held), and ``nrl resume``
  with a changed gate goes on from there (slow);
- a reward-model stage scores the later GRPO or PPO stages (``sft -> rm -> ppo`` end to end, slow),
  a distillation stage trains the last stage's weights against its own teacher (``sft -> distill``,
  slow).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
import yaml

from tests.faults.helpers import run_nrl, train_checksum
from tests.fixtures.grpo_runs import REPO

PIPELINE = os.path.join(REPO, "configs", "pipeline_tiny.yaml")


def _pipeline_file(tmp_path, model_dir: str, stages: list[dict]) -> str:
    """A pipeline file next to copies of the tiny configs, on the session's tiny model."""
    for name in ("sft_tiny.yaml", "dpo_tiny.yaml", "grpo_tiny.yaml", "rm_tiny.yaml", "distillation_tiny.yaml", "ppo_tiny.yaml"):
        with open(os.path.join(REPO, "configs", name), encoding="utf-8") as fh:
            cfg = yaml.safe_load(fh)
        cfg["policy"]["model_name"] = model_dir
        cfg.setdefault("logger", {})["console"] = False
        (tmp_path / name).write_text(yaml.safe_dump(cfg))
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"stages": stages}))
    return str(path)


def _tiny_pipeline(tmp_path, model_dir: str) -> str:
    with open(PIPELINE, encoding="utf-8") as fh:
        return _pipeline_file(tmp_path, model_dir, yaml.safe_load(fh)["stages"])


def _state(root: str, pid: str) -> dict:
    with open(os.path.join(root, pid, "pipeline.json"), encoding="utf-8") as fh:
        return json.load(fh)


def test_every_stage_is_checked_before_anything_starts(tmp_path, tiny_model_dir, capsys):
    from flows.cli import main

    path = _pipeline_file(tmp_path, tiny_model_dir, [
        {"name": "sft", "config": "sft_tiny.yaml", "overrides": ["sft.no_such_key=1"]},
        {"name": "dpo", "config": "dpo_tiny.yaml", "overrides": ["data.dataset=file", "data.train_path=/nonexistent/pairs.jsonl"]},
        {"name": "grpo", "config": "grpo_tiny.yaml"},
    ])
    root = tmp_path / "runs"
    assert main(["pipeline", "--config", path, "--storage", str(root), "--run-id", "P"]) == 2
    err = capsys.readouterr().err
    assert err.count("nrl: error:") == 1 and "2 problem(s)" in err, err
    assert "stage 'sft'" in err and "sft.no_such_key" in err and "stage 'dpo'" in err and "/nonexistent/pairs.jsonl" in err, err
    assert not (root / "P").exists() and not (root / "P-sft").exists()


def test_a_pipeline_file_names_each_problem():
    from nrl_tasks.config.pipeline import PipelineConfig

    for stages, needle in (
        ([{"name": "a", "eval": {}}], "is an evaluation: it has no run to evaluate"),
        ([{"name": "a", "config": "x.yaml"}, {"name": "a", "config": "y.yaml"}], "must be unique"),
        ([{"name": "a", "config": "x.yaml", "eval": {}}], "either `config`"),
        ([{"name": "a", "config": "x.yaml", "gate": {"metric": "val_loss"}}], "needs min or max"),
    ):
        with pytest.raises(ValueError, match=needle):
            PipelineConfig.model_validate({"stages": stages})


def _flow_runs(name_like: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async def read():
        async with get_client() as client:
            return await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=name_like)), limit=200)

    return asyncio.run(read())


def _parent_flow_run(run) -> str | None:
    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            return (await client.read_task_run(run.parent_task_run_id)).flow_run_id if run.parent_task_run_id else None

    return str(asyncio.run(read()) or "") or None


@pytest.fixture(scope="module")
def tiny_pipeline(prefect_harness, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    root = str(tmp / "runs")
    path = _tiny_pipeline(tmp, tiny_model_dir)
    proc = run_nrl(["pipeline", "--config", path, "--storage", root, "--run-id", "P"], prefect_harness, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"root": root, "path": path, "tmp": tmp, "stdout": proc.stdout}


@pytest.mark.slow  # a whole pipeline: four stage runs
def test_the_pipeline_runs_each_stage_from_the_last_ones_checkpoint(tiny_pipeline):
    root = tiny_pipeline["root"]
    assert sorted(d for d in os.listdir(root) if d.startswith("P")) == ["P", "P-dpo", "P-grpo", "P-sft"]
    state = _state(root, "P")
    assert state["status"] == "completed" and list(state["stages"]) == ["sft", "dpo", "grpo", "eval"]
    for stage, before in (("dpo", "sft"), ("grpo", "dpo")):
        saved = yaml.safe_load(open(os.path.join(root, f"P-{stage}", "config.yaml"), encoding="utf-8"))
        want = os.path.join(state["stages"][before]["final_checkpoint"], "weights")
        assert saved["policy"]["model_name"] == want == state["stages"][stage]["start_model"]
    assert state["stages"]["sft"]["gate"]["held"] and state["stages"]["dpo"]["gate"]["held"]
    assert 0.0 <= state["stages"]["eval"]["figures"]["accuracy"] <= 1.0


@pytest.mark.slow  # a whole pipeline
def test_prefect_shows_one_pipeline_flow_run_with_a_subflow_per_stage(tiny_pipeline):
    from tests.flows.test_supervised_recipes import _read_artifact

    from flows.observe.artifacts import artifact_key

    top = [r for r in _flow_runs("P") if r.name == "P"]
    assert len(top) == 1 and top[0].state.is_completed() and top[0].parent_task_run_id is None
    children = {}
    for r in _flow_runs("P-%") + _flow_runs("eval-P-%"):
        if _parent_flow_run(r) == str(top[0].id):
            children[r.name] = r
    assert {"P-sft", "P-dpo", "P-grpo"} <= set(children), sorted(children)
    assert any(n.startswith("eval-P-grpo-step_") for n in children), sorted(children)  # the eval stage
    md = _read_artifact(artifact_key("P", "summary"))
    assert "4 of 4 stage(s) done (completed)" in md
    for stage in ("sft", "dpo", "grpo"):
        assert f"`P-{stage}`" in md and f"### {stage} (" in md
    assert md.count("data:image/png;base64,") == 3 and "val_accuracy >= 0.4" in md


@pytest.mark.slow  # a killed pipeline and its resume
def test_killed_in_the_dpo_stage_then_resumed_is_bit_identical(tiny_pipeline, prefect_harness, tiny_model_dir, tmp_path):
    root = str(tmp_path / "runs")
    path = _tiny_pipeline(tmp_path, tiny_model_dir)
    proc = run_nrl(["pipeline", "--config", path, "--storage", root, "--run-id", "P"], prefect_harness,
                   kill_at="dpo_train@3:during", timeout=900)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-3000:]
    sft_ck = os.path.join(root, "P-sft", "checkpoints", "step_000020", "checkpoint.json")
    stamp = os.stat(sft_ck).st_mtime_ns
    proc = run_nrl(["resume", "P", "--storage", root], prefect_harness, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = _state(root, "P")
    assert state["status"] == "completed" and state["stages"]["sft"]["outcome"] == "skipped (finished)"
    assert state["stages"]["dpo"]["outcome"] == "resumed" and os.stat(sft_ck).st_mtime_ns == stamp
    sft_status = json.load(open(os.path.join(root, "P-sft", "status.json"), encoding="utf-8"))
    assert len(sft_status["history"]) == 1  # the SFT run was not run again
    ref = tiny_pipeline["root"]
    for stage, steps in (("dpo", 6), ("grpo", 4)):
        assert [train_checksum(root, f"P-{stage}", s) for s in range(1, steps + 1)] == [
            train_checksum(ref, f"P-{stage}", s) for s in range(1, steps + 1)]


@pytest.mark.slow  # two short pipelines' flow runs
def test_a_gate_not_met_stops_the_pipeline_and_a_resume_with_another_gate_goes_on(prefect_harness, tiny_model_dir, tmp_path):
    path = _pipeline_file(tmp_path, tiny_model_dir, [
        {"name": "sft", "config": "sft_tiny.yaml", "overrides": ["sft.max_num_steps=4", "sft.val_period=4"],
         "gate": {"metric": "val_loss", "max": 0.01}},
        {"name": "grpo", "config": "grpo_tiny.yaml", "overrides": ["grpo.max_num_steps=1"]},
    ])
    root = str(tmp_path / "runs")
    proc = run_nrl(["pipeline", "--config", path, "--storage", root, "--run-id", "G"], prefect_harness, timeout=600)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "stopped after stage sft: its gate val_loss <= 0.01 did not hold" in proc.stdout, proc.stdout
    assert "stage grpo was not started" in proc.stdout
    state = _state(root, "G")
    assert state["status"] == "gated" and not state["stages"]["sft"]["gate"]["held"]
    assert not os.path.exists(os.path.join(root, "G-grpo"))
    top = [r for r in _flow_runs("G") if r.name == "G"][0]
    assert top.state.is_completed() and top.state.name == "Gated" and "did not hold" in (top.state.message or "")

    proc = run_nrl(["resume", "G", "--storage", root, "stages.sft.gate.max=100"], prefect_harness, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    state = _state(root, "G")
    assert state["status"] == "completed" and state["stages"]["sft"]["gate"]["held"]
    assert state["stages"]["sft"]["outcome"] == "skipped (finished)" and state["stages"]["grpo"]["outcome"] == "ran"


RM_STAGES = [
    {"name": "sft", "config": "sft_tiny.yaml", "overrides": ["sft.max_num_steps=4", "checkpointing.save_period=4"]},
    {"name": "rm", "config": "rm_tiny.yaml", "overrides": ["rm.max_num_steps=4", "rm.val_period=4", "checkpointing.save_period=4"]},
    {"name": "grpo", "config": "grpo_tiny.yaml", "overrides": ["grpo.max_num_steps=2"]},
    {"name": "eval", "eval": {"num_samples": 1, "max_prompts": 8}},
]


def test_a_reward_model_stage_scores_the_later_stages_and_the_policy_chain_skips_it(tmp_path, tiny_model_dir):
    """sft -> rm -> grpo: the RM starts from the SFT weights; GRPO starts from the SFT weights too
    and is scored by the RM's final weights (env.reward_model); the eval stage evaluates GRPO."""
    from flows.pipeline import final_weights, load_pipeline, plan_stages

    root = str(tmp_path / "runs")
    plans = plan_stages(load_pipeline(_pipeline_file(tmp_path, tiny_model_dir, RM_STAGES)), root, "P")
    sft, rm, grpo, _ = plans
    sft_weights, rm_weights = final_weights(root, "P-sft", 4), final_weights(root, "P-rm", 4)
    assert rm["cfg"].policy.model_name == sft_weights and rm["cfg"].policy.reward_model_cfg.enabled
    assert grpo["cfg"].policy.model_name == sft_weights
    assert grpo["cfg"].env.reward_model.enabled and grpo["cfg"].env.reward_model.model_name == rm_weights
    assert not sft["cfg"].env.reward_model.enabled and not os.path.exists(os.path.join(root, "P"))


DISTILL_STAGES = [
    {"name": "sft", "config": "sft_tiny.yaml", "overrides": ["sft.max_num_steps=2", "checkpointing.save_period=2"]},
    {"name": "distill", "config": "distillation_tiny.yaml",
     "overrides": ["distillation.max_num_steps=2", "distillation.val_period=2", "checkpointing.save_period=2"]},
    {"name": "eval", "eval": {"num_samples": 1, "max_prompts": 8}},
]


def test_a_distillation_stage_trains_the_last_stages_weights_against_its_own_teacher(tmp_path, tiny_model_dir):
    from flows.pipeline import final_weights, load_pipeline, plan_stages

    root = str(tmp_path / "runs")
    sft, distill, _ = plan_stages(load_pipeline(_pipeline_file(tmp_path, tiny_model_dir, DISTILL_STAGES)), root, "Q")
    assert distill["cfg"].kind == "distill" and distill["cfg"].policy.model_name == final_weights(root, "Q-sft", 2)
    assert distill["cfg"].teacher.model_name == "builtin:tiny-seed3"  # the teacher is the stage's own


@pytest.mark.slow  # a whole pipeline: two stage runs and an evaluation
def test_sft_then_distillation_runs_end_to_end(prefect_harness, tiny_model_dir, tmp_path):
    root = str(tmp_path / "runs")
    path = _pipeline_file(tmp_path, tiny_model_dir, DISTILL_STAGES)
    proc = run_nrl(["pipeline", "--config", path, "--storage", root, "--run-id", "D"], prefect_harness, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = _state(root, "D")
    assert state["status"] == "completed" and list(state["stages"]) == ["sft", "distill", "eval"]
    assert state["stages"]["eval"]["run_id"] == "D-distill" and 0.0 <= state["stages"]["eval"]["figures"]["accuracy"] <= 1.0
    saved = yaml.safe_load(open(os.path.join(root, "D-distill", "config.yaml"), encoding="utf-8"))
    assert saved["policy"]["model_name"] == os.path.join(state["stages"]["sft"]["final_checkpoint"], "weights")
    assert os.path.isdir(os.path.join(root, "D-distill", "steps", "step_000002", "teacher"))


PPO_STAGES = [
    *RM_STAGES[:2],
    {"name": "ppo", "config": "ppo_tiny.yaml", "overrides": ["ppo.max_num_steps=2", "ppo.val_period=2",
                                                              "checkpointing.save_period=2"]},
    {"name": "eval", "eval": {"num_samples": 1, "max_prompts": 8}},
]


def test_a_reward_model_stage_scores_a_later_ppo_stage(tmp_path, tiny_model_dir):
    from flows.pipeline import final_weights, load_pipeline, plan_stages

    root = str(tmp_path / "runs")
    _, _, ppo, _ = plan_stages(load_pipeline(_pipeline_file(tmp_path, tiny_model_dir, PPO_STAGES)), root, "Z")
    assert ppo["cfg"].kind == "ppo" and ppo["cfg"].policy.model_name == final_weights(root, "Z-sft", 4)
    assert ppo["cfg"].env.reward_model.enabled and ppo["cfg"].env.reward_model.model_name == final_weights(root, "Z-rm", 4)


@pytest.mark.slow  # a whole pipeline: three stage runs and an evaluation
def test_sft_then_reward_model_then_ppo_scored_by_it_runs_end_to_end(prefect_harness, tiny_model_dir, tmp_path):
    """(It stands for sft -> rm -> grpo too, whose plan is checked above: the stages score alike.)"""
    import storage

    root = str(tmp_path / "runs")
    path = _pipeline_file(tmp_path, tiny_model_dir, PPO_STAGES)
    proc = run_nrl(["pipeline", "--config", path, "--storage", root, "--run-id", "Y"], prefect_harness, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = _state(root, "Y")
    assert state["status"] == "completed" and list(state["stages"]) == ["sft", "rm", "ppo", "eval"]
    assert state["stages"]["eval"]["run_id"] == "Y-ppo"  # the last policy stage, not the reward model
    assert 0.0 <= state["stages"]["eval"]["figures"]["accuracy"] <= 1.0  # the task's exact match, not the RM's score
    saved = yaml.safe_load(open(os.path.join(root, "Y-ppo", "config.yaml"), encoding="utf-8"))
    assert saved["env"]["reward_model"]["model_name"] == os.path.join(state["stages"]["rm"]["final_checkpoint"], "weights")
    rewards = storage.load_batch(os.path.join(root, "Y-ppo", "steps", "step_000001", "rewards"))["rewards"]
    assert any(float(r) not in (0.0, 1.0) for r in rewards), rewards  # the reward model's scores
    assert os.path.isdir(os.path.join(root, "Y-ppo", "checkpoints", "step_000002", "value", "weights"))
