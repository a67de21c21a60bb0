"""Malformed or adversarial inputs: each gets a clear error (``ValueError``/``TypeError`` naming
the key, file, line or row) and leaves the run intact (nothing committed, nothing started), or,
for rewards, is masked and counted instead of ending the run.

Covered: prompt files with missing fields, empty prompts, non-UTF-8 text (JSONL and Arrow),
over-long prompts (``data.overlong_prompts`` reject/truncate, checked for the whole dataset
before Ray starts), reward functions that raise or return NaN, configs with unknown keys or
impossible batch sizes, storage roots that do not exist, cannot be created or are not writable.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest
import torch

from flows.config import ConfigError, load_config
from nrl_tasks.stages.data import check_prompt_lengths, load_prompt_file, tokenize_prompts
from storage.retry import retry_policy
from tests.flows.conftest import TINY_CONFIG


def _jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# --------------------------------------------------------------------------- prompt files
def test_missing_fields_name_the_field_file_and_line(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 1+1?", "answer": "2"}, "", {"question": "x", "answer": "1"}])
    with pytest.raises(ValueError) as info:
        load_prompt_file(path)
    msg = str(info.value)
    assert path in msg and "line 3" in msg and "missing field 'prompt'" in msg and "data.prompt_key" in msg
    assert "['answer', 'question']" in msg  # the fields the row does have
    path = _jsonl(tmp_path / "a.jsonl", [{"prompt": "a?", "answer": "1"}, {"prompt": "b?"}])
    with pytest.raises(ValueError, match=r"line 2, row 1: missing field 'answer' \(data.answer_key\)"):
        load_prompt_file(path)
    # no answers at all is allowed (a reward function may need none)
    assert load_prompt_file(_jsonl(tmp_path / "n.jsonl", [{"prompt": "a?"}]))[0]["answer"] == ""


@pytest.mark.parametrize("prompt, needle", [("", "empty prompt"), ("  \n\t", "empty prompt"), (7, "is int, not str"), (None, "is NoneType")])
def test_empty_or_non_text_prompts(tmp_path, prompt, needle):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "fine?", "answer": "1"}, {"prompt": prompt, "answer": "2"}])
    with pytest.raises(ValueError, match=needle) as info:
        load_prompt_file(path)
    assert path in str(info.value) and "line 2" in str(info.value)


def test_non_utf8_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok?", "answer": "1"}\n{"prompt": "ok?", "answer": "2"}\n{"prompt": "caf\xe9?", "answer": "3"}\n')
    with pytest.raises(ValueError) as info:
        load_prompt_file(str(path))
    msg = str(info.value)
    assert str(path) in msg and "line 3" in msg and "not UTF-8" in msg and "column 16" in msg


def test_non_utf8_arrow_strings_name_the_file(tmp_path):
    bad = b"caf\xe9"
    offsets = pa.py_buffer(bytes(memoryview(torch.tensor([0, 3, 3 + len(bad)], dtype=torch.int32).numpy())))
    prompts = pa.Array.from_buffers(pa.utf8(), 2, [None, offsets, pa.py_buffer(b"ok?" + bad)])
    table = pa.table({"prompt": prompts, "answer": pa.array(["1", "2"])})
    path = str(tmp_path / "p.arrow")
    with pa.ipc.new_file(path, table.schema) as w:
        w.write_table(table)
    with pytest.raises(ValueError, match="not UTF-8") as info:
        load_prompt_file(path)
    assert path in str(info.value)


# --------------------------------------------------------------------------- over-long prompts
def _data_cfg(**kw):
    return load_config(TINY_CONFIG, [f"data.{k}={v}" for k, v in kw.items()]).data


def test_overlong_prompts_rejected_or_truncated_per_config(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    records = [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "What is 1+1? " * 40, "answer": "2"}]
    budget = 16
    with pytest.raises(ValueError) as info:
        check_prompt_lengths(records, _data_cfg(overlong_prompts="reject"), tok, budget, source="prompts.jsonl")
    msg = str(info.value)
    assert "prompts.jsonl" in msg and "record 1 (" in msg and f"longer than {budget} tokens" in msg
    assert "data.overlong_prompts=truncate" in msg
    truncate = _data_cfg(overlong_prompts="truncate")
    assert check_prompt_lengths(records, truncate, tok, budget) == 1
    ids, lengths = tokenize_prompts([r["prompt"] for r in records], tok, max_length=budget, overlong="truncate")
    assert lengths.tolist()[1] == budget and ids.shape[1] == budget
    full = tok(records[1]["prompt"], add_special_tokens=False)["input_ids"]
    assert ids[1].tolist() == full[-budget:]  # the end of the prompt (next to the answer) is kept


def test_bad_prompt_file_fails_the_run_setup_before_ray(tmp_path, tiny_model_dir, monkeypatch):
    """A run on a file dataset with an over-long (or malformed) prompt stops at data loading
    (its recipe's ``prepare``, which the flow runs before it starts the runtime): one clear
    error, Ray never contacted, no data snapshot committed."""
    import storage
    import flows.run.runtime
    from flows.algorithms.grpo import GRPO
    from flows.run.runtime import load_tokenizer
    from nrl_tasks.run_layout import RunLayout, join_uri

    def tripwire(*a, **k):
        raise AssertionError("Ray was contacted despite bad input")

    monkeypatch.setattr(flows.run.runtime, "connect_ray", tripwire)
    good = [{"prompt": f"What is {i}+1? Answer:", "answer": str(i + 1)} for i in range(8)]
    cases = {
        "long.jsonl": (good + [{"prompt": "What is 1+1? " * 40, "answer": "2"}], "longer than"),
        "broken.jsonl": (good + [{"prompt_text": "x", "answer": "1"}], "missing field 'prompt'"),
    }
    for name, (rows, needle) in cases.items():
        path = _jsonl(tmp_path / name, rows)
        root = str(tmp_path / f"runs-{name}")
        cfg = load_config(
            TINY_CONFIG,
            [f"policy.model_name={tiny_model_dir}", f"storage.root={root}", "data.dataset=file", f"data.train_path={path}"],
        )
        with pytest.raises(ValueError, match=needle) as info:
            GRPO.prepare(RunLayout(root, "bad-data"), cfg, load_tokenizer(cfg))
        assert path in str(info.value)
        assert not storage.is_committed(join_uri(root, "bad-data", "data", "train"))


# --------------------------------------------------------------------------- rewards
def _score_with(reward_fn: str, tmp_path, *, steps=(1,), overrides=()):
    """Run the ``score`` stage of ``steps`` (the last one's outputs returned) on persisted rollouts
    with ``env.reward_fn``."""
    import types

    import storage
    from flows.run.runtime import build_run_context
    from nrl_tasks.run_layout import RunLayout
    from nrl_tasks.stages.runner import committed_ref
    from nrl_tasks.stages.score import score

    root = str(tmp_path / "runs")
    cfg = load_config(TINY_CONFIG, [f"storage.root={root}", f"env.reward_fn={reward_fn}", *overrides])
    run_id = f"reward-{reward_fn.rsplit(':', 1)[1]}"
    layout = RunLayout(root, run_id)
    no_actors = types.SimpleNamespace(namespace="-", policy=None, generation=None, reward_model=None)
    run = build_run_context(cfg, run_id, no_actors, tokenizer=None)
    for step in steps:
        storage.save_batch(
            {
                "prompt": ["What is 1+1? Answer:"] * 4 + ["What is 2+2? Answer:"] * 4,
                "response": [" 2", " 3", " two", "2"] + [" 4", " 44", " 5", "four"],
                "answer": ["2"] * 4 + ["4"] * 4,
                "group_id": torch.tensor([0] * 4 + [1] * 4),
            },
            layout.stage_uri(step, "rollouts"),
            run_id=run_id, step=step, stage="rollouts",
        )
        out = score.fn(run.step(step), committed_ref(layout.stage_uri(step, "rollouts"))).summary()
    rewards = storage.load_batch(layout.stage_uri(steps[-1], "rewards"))
    rollouts = storage.load_batch(layout.stage_uri(steps[-1], "rollouts"))
    return cfg, out, rewards, rollouts


def test_nan_rewards_are_masked_and_counted_in_the_metrics_line(tmp_path):
    from flows.observe.metrics import build_step_metrics
    from nrl_tasks.stages.advantages import compute_advantages

    cfg, out, rewards, rollouts = _score_with("tests.faults.reward_plugins:nan_for_long_responses", tmp_path)
    assert rewards["reward_valid"].tolist() == [True, True, False, True, True, False, True, False]
    assert rewards["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert torch.isfinite(rewards["rewards"]).all()
    assert out["invalid_rewards"] == 3 and "3 of 8 rewards invalid" in out["reward_errors"]
    adv = compute_advantages(rollouts["group_id"], rewards["rewards"], rewards["reward_valid"], cfg.grpo)
    assert adv["sample_mask"].tolist() == rewards["reward_valid"].float().tolist()
    assert torch.isfinite(adv["advantages"]).all()
    assert (adv["advantages"][~rewards["reward_valid"]] == 0).all()  # masked samples do not train
    row = build_step_metrics(1, {"rewards": out}, rewards=(rewards["rewards"], rewards["reward_valid"]))
    assert row["invalid_rewards"] == 3
    assert row["reward_mean"] == pytest.approx(3 / 5)  # over the 5 valid samples only


def test_raising_reward_function_masks_the_step_instead_of_ending_the_run(tmp_path):
    cfg, out, rewards, rollouts = _score_with("tests.faults.reward_plugins:always_raises", tmp_path)
    assert not rewards["reward_valid"].any() and out["invalid_rewards"] == 8
    assert "RuntimeError: reward service unavailable" in out["reward_errors"]
    assert out["reward_mean"] is None  # no valid reward (JSON has no NaN)
    from nrl_tasks.stages.advantages import compute_advantages

    adv = compute_advantages(rollouts["group_id"], rewards["rewards"], rewards["reward_valid"], cfg.grpo)
    assert adv["sample_mask"].sum() == 0 and (adv["advantages"] == 0).all()


def test_consecutive_steps_without_a_valid_reward_stop_the_run_naming_the_source(tmp_path):
    """One step with no valid reward is masked (above); the next one too stops the run, naming the
    reward source and the key (was: a run of NaN rewards only finished ``completed`` with loss 0)."""
    from nrl_tasks.stages.errors import is_actor_fault
    from nrl_tasks.stages.score import NoValidRewardError

    fn = "tests.faults.reward_plugins:always_raises"
    with pytest.raises(NoValidRewardError, match=r"steps 1-2: no valid reward in 2 consecutive steps from "
                       r"tests\.faults\.reward_plugins:always_raises .*grpo\.max_steps_without_valid_reward=1") as ei:
        _score_with(fn, tmp_path / "a", steps=(1, 2))
    assert not is_actor_fault(ei.value)
    with pytest.raises(NoValidRewardError, match="steps 1-1"):  # 0: the first such step stops it
        _score_with(fn, tmp_path / "b", overrides=["grpo.max_steps_without_valid_reward=0"])
    _, out, _, _ = _score_with(fn, tmp_path / "c", steps=(1, 2), overrides=["grpo.max_steps_without_valid_reward=2"])
    assert out["invalid_rewards"] == 8  # tolerated: masked


def test_unimportable_reward_function_is_a_clear_error():
    from nrl_tasks.stages.score import reward_function

    cfg = load_config(TINY_CONFIG, ["env.reward_fn=tests.faults.reward_plugins:no_such_fn"])
    with pytest.raises(ValueError, match="has no attribute 'no_such_fn'"):
        reward_function(cfg.env)


# --------------------------------------------------------------------------- configs
@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["grpo.num_promts_per_step=4", "policy.optimiser.name=x"], ["grpo.num_promts_per_step: unknown key", "policy.optimiser: unknown key"]),
        (["storage.retry.attemps=3"], ["storage.retry.attemps: unknown key"]),
        (["grpo.num_prompts_per_step=3"], ["= 12 is not a multiple of policy.train_global_batch_size = 16"]),
        (["cluster.policy_workers=3"], ["policy.train_global_batch_size = 16 is not a multiple of policy.train_micro_batch_size * cluster.policy_workers = 8 * 3"]),
        (["policy.train_micro_batch_size=32"], ["train_micro_batch_size (32) exceeds train_global_batch_size (16)"]),
        (["policy.train_global_batch_size=0"], ["policy.train_global_batch_size"]),
        (["grpo.num_generations_per_prompt=1"], ["grpo.num_generations_per_prompt"]),
        (["data.max_input_seq_length=60"], ["exceeds policy.max_total_sequence_length"]),
        (["data.overlong_prompts=drop"], ["data.overlong_prompts"]),
        (["storage.retry.attempts=0"], ["storage.retry.attempts"]),
    ],
)
def test_bad_configs_list_every_problem(overrides, needles):
    with pytest.raises(ConfigError) as info:
        load_config(TINY_CONFIG, overrides)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


# --------------------------------------------------------------------------- storage roots
def test_storage_roots_that_cannot_hold_a_run(tmp_path, moto_s3):
    from flows.run.state import check_storage_root

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot be created"):
        check_storage_root(str(blocker / "runs"))
    if os.geteuid() == 0:
        locked = "/sys"  # root may write anywhere permission bits allow; sysfs refuses new files
    else:
        locked = str(tmp_path / "locked")
        os.mkdir(locked, 0o500)
    with pytest.raises(ValueError, match="not writable") as info:
        check_storage_root(locked)
    assert locked in str(info.value)
    with pytest.raises(ValueError, match="unsupported scheme 'gs'"):
        check_storage_root("gs://bucket/runs")
    opts = moto_s3.storage_options
    with pytest.raises(ValueError, match="bucket 'no-such-bucket-nrl' does not exist"):
        check_storage_root("s3://no-such-bucket-nrl/runs", opts)
    with pytest.raises(ValueError, match="invalid bucket name"):
        check_storage_root("s3://ab/runs", opts)
    from tests.fixtures.s3 import free_port

    down = {**opts, "endpoint_url": f"http://127.0.0.1:{free_port()}"}
    with retry_policy(attempts=2, initial_delay_s=0.01), pytest.raises(ValueError, match="is not reachable") as info:
        check_storage_root("s3://some-bucket/runs", down)
    assert "s3://some-bucket/runs" in str(info.value) and moto_s3.secret not in str(info.value)
    bucket = moto_s3.make_bucket()
    assert check_storage_root(bucket + "/runs", opts) == bucket + "/runs"


def test_cli_refuses_an_unwritable_storage_root_before_anything_starts(monkeypatch, capsys):
    import flows.algorithms.grpo
    import flows.run.runtime
    from flows.cli import main

    def tripwire(*a, **k):
        raise AssertionError("a run started despite an unusable storage root")

    monkeypatch.setattr(flows.run.runtime, "connect_ray", tripwire)
    monkeypatch.setattr(flows.algorithms.grpo, "grpo", tripwire)
    root = "/sys/nrl-runs" if os.geteuid() == 0 else "/proc/nrl-runs"
    assert main(["grpo", "--config", TINY_CONFIG, "--storage", root]) == 2
    err = capsys.readouterr().err
    assert err.count("nrl: error:") == 1 and root in err
