"""``nrl ppo`` (PPO with a value model, issue 43) through the real flow: the tiny policy samples on a
Ray generation worker, the value model (the same tiny Llama with a one-output head) runs in Ray
workers of its own, real Prefect runs, Arrow on disk (``configs/ppo_tiny.yaml``: 4 steps of
2 PPO epochs, step 1 a critic warm-up, validation and checkpoints at 2 and 4).

Checked: every step persists its values ``[B, S]``, GAE advantages and returns and the train
figures of both models; step 1 trains the value model alone (the policy's weights unchanged);
the value loss falls; checkpoints hold both models (``value/weights`` a one-output classifier);
the flow SIGKILLed in step 3's update and resumed ends with both models' weights of the
uninterrupted run (slow); configs PPO cannot honour are refused naming the keys.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import yaml

from tests.faults.helpers import run_nrl, train_checksum
from tests.fixtures.grpo_runs import REPO, kill_run_actors, tiny_run_config

RUN_ID = "ppo-tiny"
STEPS = (1, 2, 3, 4)
CONFIG = os.path.join(REPO, "configs", "ppo_tiny.yaml")


def _config(model_dir: str, root: str, ray_address: str | None) -> dict:
    return tiny_run_config(model_dir, root, ray_address, config=CONFIG, **{"ppo.max_num_steps": len(STEPS)})


@pytest.fixture(scope="module")
def ppo_run(prefect_harness, ray_session, tiny_model_dir, tmp_path_factory):
    from flows.algorithms.ppo import ppo

    root = str(tmp_path_factory.mktemp("ppo") / "runs")
    try:
        out = ppo(config=_config(tiny_model_dir, root, ray_session), run_id=RUN_ID)
    finally:
        kill_run_actors(RUN_ID)
    return {"root": root, "out": out}


def _step_dir(root: str, run_id: str, step: int) -> str:
    return os.path.join(root, run_id, "steps", f"step_{step:06d}")


def _meta(root: str, run_id: str, step: int, name: str) -> dict:
    import storage

    return storage.read_manifest(os.path.join(_step_dir(root, run_id, step), name)).meta


def test_each_step_persists_values_and_gae_and_trains_both_models(ppo_run):
    import storage
    from flows.observe.metrics import read_metrics

    root = ppo_run["root"]
    rows = read_metrics(os.path.join(root, RUN_ID, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(STEPS)
    assert [r["policy_warmup"] for r in rows] == [True, False, False, False]
    assert rows[0]["loss"] is None and all(r["loss"] is not None for r in rows[1:])  # no policy update in warm-up
    assert all(r["value_loss"] > 0 and r["values_s"] is not None and r["gae_s"] is not None for r in rows)
    assert [r["step"] for r in rows if r.get("val_accuracy") is not None] == [2, 4]
    for s in STEPS:
        d = _step_dir(root, RUN_ID, s)
        assert sorted(os.listdir(d)) == sorted(["prompts", "rollouts", "rewards", "logprobs", "values", "advantages", "train"]
                                               + (["val"] if s % 2 == 0 else []))
        r = storage.load_batch(os.path.join(d, "rollouts"), columns=["input_ids", "token_mask"])
        v = storage.load_batch(os.path.join(d, "values"))["values"]
        adv = storage.load_batch(os.path.join(d, "advantages"))
        assert tuple(v.shape) == tuple(r["input_ids"].shape) and float(v[:, 0].abs().sum()) == 0.0  # no state before token 0
        outside = (r["token_mask"] == 0)
        assert float(adv["advantages"][outside].abs().sum()) == 0.0 and float(adv["returns"][outside].abs().sum()) == 0.0
    # warm-up: step 1 moved only the value model; from step 2 both models train every step
    policy = [_meta(root, RUN_ID, s, "train")["weights_checksum"] for s in STEPS]
    assert _meta(root, RUN_ID, 1, "train")["policy_warmup"] and len(set(policy)) == len(STEPS)
    assert len({_meta(root, RUN_ID, s, "train")["value_weights_checksum"] for s in STEPS}) == len(STEPS)
    ckpt = os.path.join(root, RUN_ID, "checkpoints", "step_000004")
    with open(os.path.join(ckpt, "value", "weights", "config.json"), encoding="utf-8") as fh:
        hf = json.load(fh)
    assert hf["architectures"] == ["LlamaForSequenceClassification"] and hf.get("num_labels", 1) == 1
    with open(os.path.join(ckpt, "weights", "config.json"), encoding="utf-8") as fh:
        assert json.load(fh)["architectures"] == ["LlamaForCausalLM"]
    with open(os.path.join(root, RUN_ID, "status.json"), encoding="utf-8") as fh:
        assert json.load(fh)["algorithm"] == "ppo"


@pytest.mark.slow  # a killed whole-flow run and its resume
def test_killed_mid_update_then_resumed_restores_both_models_bit_identically(
        ppo_run, tmp_path, prefect_harness, ray_session, tiny_model_dir):
    root = str(tmp_path / "runs")
    cfg_path = tmp_path / "ppo.yaml"
    cfg_path.write_text(yaml.safe_dump(_config(tiny_model_dir, root, ray_session)))
    run_id = "ppo-kill"
    try:
        p = run_nrl(["ppo", "--config", str(cfg_path), "--run-id", run_id], prefect_harness, kill_at="ppo_train@3:during")
        assert p.returncode == -signal.SIGKILL, p.stdout[-2000:] + p.stderr[-3000:]
        kill_run_actors(run_id)
        p = run_nrl(["resume", run_id, "--storage", root], prefect_harness)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        kill_run_actors(run_id)
    with open(os.path.join(root, run_id, "status.json"), encoding="utf-8") as fh:
        status = json.load(fh)
    assert status["status"] == "completed" and status["restored"]["restored_from"].endswith("step_000002")
    ref = ppo_run["root"]
    assert [train_checksum(root, run_id, s) for s in STEPS] == [train_checksum(ref, RUN_ID, s) for s in STEPS]
    assert [_meta(root, run_id, s, "train")["value_weights_checksum"] for s in STEPS] == \
        [_meta(ref, RUN_ID, s, "train")["value_weights_checksum"] for s in STEPS]


@pytest.mark.parametrize(("overrides", "message"), [
    (["ppo.async_ppo.enabled=true"], "ppo.async_ppo.enabled: not built for PPO"),
    (["ppo.use_dynamic_sampling=true"], "ppo.use_dynamic_sampling: not built for PPO"),
    (["ppo.seq_logprob_error_threshold=2.0"], "ppo.seq_logprob_error_threshold: not built"),
    (["cluster.policy_workers=2"], "value model's data-parallel training is not built"),
    (["ppo.policy_training_start_step=4"], "the policy would never train"),
    (["loss_fn.reference_policy_kl_penalty=0.1", "ppo.skip_reference_policy_logprobs_calculation=true"],
     "reads the reference policy's logprobs"),
    (["ppo.adv_estimator.name=grpo"], "ppo.adv_estimator.name"),
])
def test_configs_ppo_cannot_honour_are_refused_naming_the_keys(overrides, message):
    from flows.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(CONFIG, overrides)


class _KillValueOnce:
    """A stage observer (``NRL_PLUGINS``) that kills the value model's actors right before step 3's
    ``values`` calls them, once per process."""

    fired = False

    def on_stage(self, ctx, stage, point):
        pass

    def on_actor_call(self, ctx, stage, role, workers):
        import ray

        if role == "value" and ctx.step == 3 and not _KillValueOnce.fired:
            _KillValueOnce.fired = True
            for w in workers:
                ray.kill(w, no_restart=True)


def value_killer() -> _KillValueOnce:
    return _KillValueOnce()


@pytest.mark.slow  # a second PPO run, with a fault
def test_a_value_model_killed_mid_run_is_restored_with_the_policy_and_the_run_ends_as_the_uninterrupted_one(
        ppo_run, tmp_path, monkeypatch, tiny_model_dir, ray_session):
    from flows.algorithms.ppo import ppo

    monkeypatch.setenv("NRL_PLUGINS", os.environ.get("NRL_PLUGINS", "") + ",tests.flows.test_ppo:value_killer")
    root = str(tmp_path / "runs")
    try:
        ppo(config=_config(tiny_model_dir, root, ray_session), run_id="ppo-fault")
    finally:
        kill_run_actors("ppo-fault")
    assert _KillValueOnce.fired
    ref = ppo_run["root"]
    from flows.observe.metrics import read_metrics

    assert _meta(root, "ppo-fault", 3, "values")["recovered"] is True  # committed after the run's recovery
    assert read_metrics(os.path.join(root, "ppo-fault", "metrics.jsonl"))[2]["values_attempts"] >= 2
    assert [train_checksum(root, "ppo-fault", s) for s in STEPS] == [train_checksum(ref, RUN_ID, s) for s in STEPS]
    assert [_meta(root, "ppo-fault", s, "train")["value_weights_checksum"] for s in STEPS] == \
        [_meta(ref, RUN_ID, s, "train")["value_weights_checksum"] for s in STEPS]
