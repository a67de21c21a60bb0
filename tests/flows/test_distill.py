"""``nrl distill`` (on-policy distillation, issue 43) through the real flow: the tiny student samples
the built-in arithmetic prompts on a Ray generation worker, a second tiny Llama (other weights,
same vocabulary) is the Ray-hosted teacher, real Prefect runs, Arrow on disk
(``configs/distillation_tiny.yaml``: 4 steps, validation and checkpoints at 2 and 4).

Checked: the KL to the teacher falls; every step persists its prompts, rollouts, rewards, the
teacher's top k (shape ``[B, S, k]`` over the rollouts' tokens) and train metrics; the checkpoint
is a causal LM; the flow SIGKILLed in step 3's update and resumed ends with the uninterrupted
run's weights at every step and never asks the teacher again for a committed step (slow);
configs the algorithm cannot honour are refused naming the keys.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import yaml

from tests.faults.helpers import run_nrl, train_checksum
from tests.fixtures.grpo_runs import REPO, kill_run_actors, tiny_run_config

RUN_ID = "distill-tiny"
STEPS = (1, 2, 3, 4)
CONFIG = os.path.join(REPO, "configs", "distillation_tiny.yaml")


def _config(model_dir: str, root: str, ray_address: str | None, **extra) -> dict:
    return tiny_run_config(model_dir, root, ray_address, config=CONFIG, **{"distillation.max_num_steps": len(STEPS), **extra})


@pytest.fixture(scope="module")
def distill_run(prefect_harness, ray_session, tiny_model_dir, tmp_path_factory):
    from flows.algorithms.distill import distill

    root = str(tmp_path_factory.mktemp("distill") / "runs")
    try:
        out = distill(config=_config(tiny_model_dir, root, ray_session), run_id=RUN_ID)
    finally:
        kill_run_actors(RUN_ID)
    return {"root": root, "out": out}


def _step_dir(root: str, run_id: str, step: int) -> str:
    return os.path.join(root, run_id, "steps", f"step_{step:06d}")


def test_the_student_moves_to_the_teacher_and_every_step_is_persisted(distill_run):
    import storage
    from flows.observe.metrics import read_metrics

    root = distill_run["root"]
    rows = read_metrics(os.path.join(root, RUN_ID, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(STEPS)
    assert rows[-1]["kl_reverse"] < rows[0]["kl_reverse"] and rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
    assert all(r["teacher_s"] is not None and r["train_attempts"] == 1 and "logprob_s" not in r for r in rows)
    assert [r["step"] for r in rows if r.get("val_accuracy") is not None] == [2, 4]
    for s in STEPS:
        d = _step_dir(root, RUN_ID, s)
        assert sorted(os.listdir(d)) == sorted(["prompts", "rollouts", "rewards", "teacher", "train"] + (["val"] if s % 2 == 0 else []))
        rollouts = storage.load_batch(os.path.join(d, "rollouts"), columns=["input_ids"])
        teacher = storage.load_batch(os.path.join(d, "teacher"))
        assert tuple(teacher["topk_indices"].shape) == (*rollouts["input_ids"].shape, 16)
        assert teacher["topk_logits"].dtype.is_floating_point and storage.read_manifest(os.path.join(d, "train")).meta["weights_checksum"]
    assert [os.path.basename(c) for c in distill_run["out"]["checkpoints"]] == ["step_000002", "step_000004"]
    with open(os.path.join(root, RUN_ID, "status.json"), encoding="utf-8") as fh:
        assert json.load(fh)["algorithm"] == "distill"
    with open(os.path.join(root, RUN_ID, "checkpoints", "step_000004", "weights", "config.json"), encoding="utf-8") as fh:
        assert json.load(fh)["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.slow  # a killed whole-flow run and its resume
def test_killed_mid_update_then_resumed_is_bit_identical_without_asking_the_teacher_again(
        distill_run, tmp_path, prefect_harness, ray_session, tiny_model_dir):
    import storage

    root = str(tmp_path / "runs")
    cfg_path = tmp_path / "distill.yaml"
    cfg_path.write_text(yaml.safe_dump(_config(tiny_model_dir, root, ray_session)))
    run_id = "distill-kill"
    try:
        p = run_nrl(["distill", "--config", str(cfg_path), "--run-id", run_id], prefect_harness,
                    kill_at="distill_train@3:during")
        assert p.returncode == -signal.SIGKILL, p.stdout[-2000:] + p.stderr[-3000:]
        kill_run_actors(run_id)
        teacher_3 = storage.read_manifest(os.path.join(_step_dir(root, run_id, 3), "teacher"))
        p = run_nrl(["resume", run_id, "--storage", root], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        kill_run_actors(run_id)
    with open(os.path.join(root, run_id, "status.json"), encoding="utf-8") as fh:
        assert json.load(fh)["status"] == "completed"
    # the teacher's top k of step 3 was committed before the kill: the resume read it, never made it again
    assert storage.read_manifest(os.path.join(_step_dir(root, run_id, 3), "teacher")).meta == teacher_3.meta
    ref = distill_run["root"]
    assert [train_checksum(root, run_id, s) for s in STEPS] == [train_checksum(ref, RUN_ID, s) for s in STEPS]


@pytest.mark.parametrize(("overrides", "message"), [
    (["teacher=null"], "distillation needs a `teacher` section"),
    (["loss_fn={ratio_clip_min: 0.1}"], "loss_fn.ratio_clip_min is a GRPO key"),
    (["grpo.async_grpo.enabled=true"], "distillation does not use grpo.async_grpo.enabled"),
    (["policy.sequence_packing={enabled: true, train_mb_tokens: 64, logprob_mb_tokens: 64}"], "sequence_packing is not built for its loss"),
    (["distillation.max_rollout_turns=2"], "needs env.environment"),
    (["distillation.num_prompts_per_step=3"], "distillation.num_prompts_per_step * distillation.num_generations_per_prompt"),
])
def test_configs_distillation_cannot_honour_are_refused_naming_the_keys(overrides, message):
    from flows.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message.replace("*", r"\*")):
        load_config(CONFIG, overrides)


def test_distillation_loss_keys_in_a_grpo_run_are_refused():
    from flows.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="loss_fn.kl_type: distillation's keys, and this config has no `distillation`"):
        load_config(os.path.join(REPO, "configs", "grpo_tiny.yaml"), ["loss_fn.kl_type=forward"])


def test_a_top_k_wider_than_the_teachers_vocabulary_is_refused_before_anything_starts(tmp_path, tiny_model_dir, capsys):
    from flows.cli import main

    cfg = _config(tiny_model_dir, str(tmp_path / "runs"), None)
    cfg["distillation"]["topk_logits_k"] = 65536
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["distill", "--config", str(path), "--run-id", "d-bad"]) == 2
    assert "distillation.topk_logits_k = 65536 exceeds the teacher's vocabulary" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "runs" / "d-bad")


@pytest.mark.slow  # a second distillation run, multi-turn
def test_a_multi_turn_environment_distils_whole_episodes(tmp_path, prefect_harness, tiny_model_dir):
    """The student plays a user environment's episodes (3 turns); the teacher scores the whole
    episode and the student trains on its own turns (token_mask), not the observations."""
    import storage

    root = str(tmp_path / "runs")
    args = ["distill", "--config", CONFIG, "--storage", root, "--run-id", "dmt", f"policy.model_name={tiny_model_dir}",
            "env.environment=tests.environments.test_multi_turn:CountdownEnvironment", "env.environment_kwargs={turns: 3}",
            "distillation.max_rollout_turns=3", "data.chat_template=true", "policy.max_total_sequence_length=160",
            "teacher.max_total_sequence_length=160", "distillation.max_num_steps=2", "distillation.val_period=2",
            "distillation.max_val_samples=4"]
    proc = run_nrl(args, prefect_harness, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for step in (1, 2):
        d = _step_dir(root, "dmt", step)
        r = storage.load_batch(os.path.join(d, "rollouts"), columns=["input_ids", "token_mask", "num_turns"])
        teacher = storage.load_batch(os.path.join(d, "teacher"))
        assert int(r["num_turns"].max()) >= 2 and tuple(teacher["topk_indices"].shape[:2]) == tuple(r["input_ids"].shape)
        assert 0 < float(r["token_mask"].sum()) < float((r["input_ids"] != 0).sum())  # observations are not trained on
        assert storage.read_manifest(os.path.join(d, "train")).meta["loss"] > 0


class _KillTeacherOnce:
    """A stage observer (``NRL_PLUGINS``) that kills the teacher's actors right before step 2's
    ``teacher_topk`` calls them, once per process."""

    fired = False

    def on_stage(self, ctx, stage, point):
        pass

    def on_actor_call(self, ctx, stage, role, workers):
        import ray

        if role == "teacher" and ctx.step == 2 and not _KillTeacherOnce.fired:
            _KillTeacherOnce.fired = True
            for w in workers:
                ray.kill(w, no_restart=True)


def teacher_killer() -> _KillTeacherOnce:
    return _KillTeacherOnce()


@pytest.mark.slow  # a second distillation run, with a fault
def test_a_teacher_killed_mid_call_is_made_again_and_the_run_ends_as_the_uninterrupted_one(
        distill_run, tmp_path, monkeypatch, tiny_model_dir, ray_session):
    import storage
    from flows.algorithms.distill import distill

    monkeypatch.setenv("NRL_PLUGINS", os.environ.get("NRL_PLUGINS", "") + ",tests.flows.test_distill:teacher_killer")
    root = str(tmp_path / "runs")
    try:
        distill(config=_config(tiny_model_dir, root, ray_session, **{"distillation.max_num_steps": 2}), run_id="d-fault")
    finally:
        kill_run_actors("d-fault")
    assert _KillTeacherOnce.fired
    ref = distill_run["root"]
    for s in (1, 2):
        assert storage.load_batch(os.path.join(_step_dir(root, "d-fault", s), "teacher"))["topk_logits"].equal(
            storage.load_batch(os.path.join(_step_dir(ref, RUN_ID, s), "teacher"))["topk_logits"])
    assert [train_checksum(root, "d-fault", s) for s in (1, 2)] == [train_checksum(ref, RUN_ID, s) for s in (1, 2)]
