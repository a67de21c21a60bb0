"""A user-written environment (tests/environments/test_multi_turn.py, not a built-in), configured
only through ``env.environment``, trains through ``nrl grpo`` with ``grpo.max_rollout_turns=3``
and is validated on whole greedy episodes; a checkpoint's evaluation runs whole episodes too;
a SIGKILL during a multi-turn ``generate`` and ``nrl resume`` end bit-identical to the
uninterrupted run; the multi-turn stage runs under async GRPO + LoRA, dynamic sampling and the
sharded (FSDP2, 2 ranks) policy."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.environments.test_multi_turn import mask_spans
from tests.faults.helpers import assert_same_rollouts, run_nrl, train_checksum
from tests.fixtures.grpo_runs import TINY_CONFIG

ENV = "tests.environments.test_multi_turn:CountdownEnvironment"
ARGS = [
    f"env.environment={ENV}", "env.environment_kwargs={turns: 3}", "env.num_workers=2", "grpo.max_rollout_turns=3",
    "data.chat_template=true", "policy.max_total_sequence_length=160", "grpo.max_num_steps=2", "checkpointing.save_period=1",
    "grpo.val_period=2", "grpo.max_val_samples=4",
]


def _grpo(root: str, run_id: str, model: str, api: str, **kw):
    return run_nrl(["grpo", "--config", TINY_CONFIG, "--storage", root, "--run-id", run_id, f"policy.model_name={model}", *ARGS],
                   api, **kw)


@pytest.fixture(scope="module")
def multi_turn_run(tmp_path_factory, tiny_model_dir, prefect_harness):
    root = str(tmp_path_factory.mktemp("multi_turn"))
    proc = _grpo(root, "mt", tiny_model_dir, prefect_harness, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"root": root, "run_id": "mt"}


def test_a_user_environment_trains_multi_turn_through_nrl_grpo(multi_turn_run, tiny_model_dir):
    import storage
    from transformers import AutoTokenizer

    root, run_id = multi_turn_run["root"], multi_turn_run["run_id"]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for step in (1, 2):
        r = storage.load_batch(os.path.join(root, run_id, "steps", f"step_{step:06d}", "rollouts"))
        assert r["num_turns"].max() >= 2
        for i in range(r.size):
            k = int(r["input_lengths"][i])
            ids, m = r["input_ids"][i, :k], r["token_mask"][i, :k].bool()
            log = json.loads(r["message_log"][i])
            observations = [msg["content"] for msg in log if msg["role"] == "user"][1:]
            assert len(observations) == int(r["num_turns"][i]) - 1
            unmasked = tok.decode(ids[~m].tolist())
            assert all(o in unmasked for o in observations)  # the observations sit at token_mask 0
            assert not any(o in tok.decode(ids[m].tolist()) for o in observations)
            assistant = [msg["content"] for msg in log if msg["role"] == "assistant"]
            assert [tok.decode(s, skip_special_tokens=True) for s in mask_spans(ids, m)] == assistant
        rw = storage.load_batch(os.path.join(root, run_id, "steps", f"step_{step:06d}", "rewards"))
        assert torch.equal(rw["rewards"], r["env_rewards"])
    with open(os.path.join(root, run_id, "metrics.jsonl")) as fh:
        rows = [json.loads(x) for x in fh]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["turns_mean"] >= 2 and row["turns_max"] <= 3 and row["env_seconds"] >= 0 for row in rows)


def test_the_rollouts_artifact_shows_whole_episodes(multi_turn_run):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.observe.artifacts import artifact_key

    async def read():
        async with get_client() as client:
            key = ArtifactFilterKey(any_=[artifact_key(multi_turn_run["run_id"], "rollouts")])
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=key), limit=10)

    arts = asyncio.run(read())
    assert arts, "no rollouts artifact"
    md = arts[0].data
    assert "## Best episode" in md and "## Worst episode" in md
    assert "**assistant**: " in md and "**user**: turn 1 of 3: go on" in md  # the environment's observation, in order


def _assert_whole_episodes(batch, tok) -> None:
    """Every row's conversation ran turns of the environment and its response is the episode."""
    for i in range(batch.size):
        log = json.loads(batch["message_log"][i])
        assistant = [m["content"] for m in log if m["role"] == "assistant"]
        assert len(assistant) == int(batch["num_turns"][i]) >= 1
        assert batch["response"][i].startswith(assistant[0])


def test_validation_runs_whole_greedy_episodes(multi_turn_run, tiny_model_dir):
    import storage
    from transformers import AutoTokenizer

    root, run_id = multi_turn_run["root"], multi_turn_run["run_id"]
    val = storage.load_batch(os.path.join(root, run_id, "steps", "step_000002", "val"))
    assert val.size == 4 and val["mode"] == ["greedy"] * 4
    assert int(val["num_turns"].max()) >= 2
    _assert_whole_episodes(val, AutoTokenizer.from_pretrained(tiny_model_dir))
    turns = val["num_turns"].to(torch.float32)
    assert torch.equal(val["reward"], 0.5 * turns + (turns == 3).float())  # the countdown's reward, summed over turns
    with open(os.path.join(root, run_id, "metrics.jsonl")) as fh:
        row = [json.loads(x) for x in fh][-1]
    assert row["step"] == 2 and row["val_turns_mean"] == float(val["num_turns"].float().mean())
    assert row["val_accuracy"] == float(val["reward"].mean())


def test_a_checkpoint_evaluation_runs_whole_episodes_and_sampled_ones(multi_turn_run, prefect_harness, tiny_model_dir):
    import storage
    from transformers import AutoTokenizer

    from flows.algorithms.evaluate import evaluate_checkpoint

    root, run_id = multi_turn_run["root"], multi_turn_run["run_id"]
    res = evaluate_checkpoint(run_id, "step_000002", storage=root, num_samples=2, max_prompts=3)
    assert res["skipped"] is False and res["rows"] == 3 + 3 * 2
    samples = storage.load_batch(res["uri"])
    assert samples["mode"] == ["greedy"] * 3 + ["sample"] * 6
    _assert_whole_episodes(samples, AutoTokenizer.from_pretrained(tiny_model_dir))
    assert res["eval_turns_mean"] == float(samples["num_turns"].float().mean())


@pytest.mark.slow  # a killed whole-flow run and its resume
def test_killed_during_a_multi_turn_generate_then_resumed_is_bit_identical(multi_turn_run, tmp_path, tiny_model_dir, prefect_harness):
    root = str(tmp_path)
    proc = _grpo(root, "mt", tiny_model_dir, prefect_harness, kill_at="generate@2:during", timeout=600)
    assert proc.returncode != 0
    proc = run_nrl(["resume", "mt", "--storage", root], prefect_harness, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for step in (1, 2):
        assert_same_rollouts(multi_turn_run["root"], "mt", root, "mt", step)
        assert train_checksum(multi_turn_run["root"], "mt", step) == train_checksum(root, "mt", step)


@pytest.mark.slow  # two whole-flow runs
def test_an_environment_that_raises_fails_the_run_naming_it_and_the_run_resumes_after_the_fix(tmp_path, tiny_model_dir, prefect_harness):
    root, broken = str(tmp_path / "runs"), tmp_path / "broken"
    broken.write_text("1")
    args = ["grpo", "--config", TINY_CONFIG, "--storage", root, "--run-id", "broken", f"policy.model_name={tiny_model_dir}",
            "env.environment=tests.environments.test_multi_turn:BrokenUntilFixedEnvironment",
            f"env.environment_kwargs={{broken: {json.dumps(str(broken))}}}", "grpo.max_rollout_turns=2", "grpo.max_num_steps=1",
            "policy.max_total_sequence_length=128"]
    proc = run_nrl(args, prefect_harness, timeout=600)
    assert proc.returncode == 1
    assert "environment tests.environments.test_multi_turn:BrokenUntilFixedEnvironment: step() raised KeyError" in proc.stderr
    broken.unlink()  # the fix
    proc = run_nrl(["resume", "broken", "--storage", root], prefect_harness, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


COMBOS = {  # the multi-turn generate stage under the features that wrap it
    "async-lora": {"grpo.async_grpo.enabled": True, "grpo.async_grpo.max_trajectory_age_steps": 1,
                   "loss_fn.use_importance_sampling_correction": True},
    "dynamic-sampling": {"grpo.use_dynamic_sampling": True, "grpo.dynamic_sampling_max_gen_batches": 8,
                         "env.environment_kwargs": {"turns": 3, "early": True}},  # rewards that differ in a group
    "sharded": {"cluster.policy_workers": 2},  # FSDP2 over 2 policy ranks (policy.dtensor_cfg, the default)
}


@pytest.mark.parametrize("combo", [pytest.param(c, marks=pytest.mark.slow) if c == "sharded" else c for c in sorted(COMBOS)])
def test_multi_turn_runs_under_async_grpo_lora_and_dynamic_sampling(combo, tmp_path, prefect_harness, ray_session, tiny_model_dir):
    import storage
    import yaml
    from transformers import AutoTokenizer

    from flows.algorithms.grpo import grpo
    from tests.flows.conftest import kill_run_actors, tiny_run_config

    run_id = f"mt-{combo}"
    cfg = tiny_run_config(tiny_model_dir, str(tmp_path), ray_session, **{
        "env.environment": ENV, "env.environment_kwargs": {"turns": 3}, "grpo.max_rollout_turns": 3, "data.chat_template": True,
        "policy.max_total_sequence_length": 160, "grpo.max_num_steps": 2, "checkpointing.enabled": False, **COMBOS[combo],
    })
    if combo.endswith("lora"):
        with open("configs/grpo_tiny_lora.yaml", encoding="utf-8") as fh:
            cfg["policy"]["dtensor_cfg"] = {"lora_cfg": yaml.safe_load(fh)["policy"]["dtensor_cfg"]["lora_cfg"]}
    try:
        out = grpo(config=cfg, run_id=run_id)
    finally:
        kill_run_actors(run_id)
    assert out["final_metrics"]["step"] == 2
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for step in (1, 2):
        r = storage.load_batch(os.path.join(str(tmp_path), run_id, "steps", f"step_{step:06d}", "rollouts"))
        assert r["num_turns"].max() >= 2
        if combo == "dynamic-sampling":
            assert len(set(r["num_turns"].tolist())) > 1  # episodes ended early and late
        for i in range(r.size):
            k = int(r["input_lengths"][i])
            ids, m = r["input_ids"][i, :k], r["token_mask"][i, :k].bool()
            assistant = [msg["content"] for msg in json.loads(r["message_log"][i]) if msg["role"] == "assistant"]
            assert [tok.decode(s, skip_special_tokens=True) for s in mask_spans(ids, m)] == assistant
